"""Loading a TensorMap onto a CUDA device: pinned staging buffers, one CUDA stream per worker, and disk reads
(the prefetch paging chunks in) overlapped with host-to-device copies.

Each worker owns a pinned buffer and a stream. It copies a slice of a tensor from its mapped chunk into the
buffer (a host memcpy that releases the GIL), queues an asynchronous copy to the device on its stream, and
waits for that copy's event only before it reuses the buffer, so N workers keep N transfers in flight.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping

import torch

from ember.errors import StoreError


def load_to_device(
    tensors: Mapping[str, torch.Tensor], device: torch.device, *, streams: int = 4, staging_mb: int = 64
) -> dict[str, torch.Tensor]:
    """Copy every tensor to `device` (CUDA: pinned staging and several streams; other devices: `.to`)."""
    if device.type != "cuda":
        return {name: t.to(device) for name, t in tensors.items()}
    if not torch.cuda.is_available():
        raise StoreError("load_to_device: CUDA is not available")
    out = {name: torch.empty(t.shape, dtype=t.dtype, device=device) for name, t in tensors.items()}
    work: queue.Queue[str | None] = queue.Queue()
    for name in tensors:
        work.put(name)
    errors: list[BaseException] = []
    workers = [
        threading.Thread(target=_worker, args=(tensors, out, work, device, staging_mb << 20, errors), daemon=True)
        for _ in range(max(1, streams))
    ]
    for w in workers:
        work.put(None)
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    torch.cuda.synchronize(device)
    return out


def _worker(
    tensors: Mapping[str, torch.Tensor],
    out: dict[str, torch.Tensor],
    work: queue.Queue[str | None],
    device: torch.device,
    staging: int,
    errors: list[BaseException],
) -> None:
    try:
        torch.cuda.set_device(device)
        stream = torch.cuda.Stream(device)
        buf = torch.empty(staging, dtype=torch.uint8, pin_memory=True)
        done = torch.cuda.Event()
        done.record(stream)
        while (name := work.get()) is not None:
            src = _bytes(tensors[name])
            dst = _bytes(out[name])
            for start in range(0, src.numel(), staging):
                n = min(staging, src.numel() - start)
                done.synchronize()  # the previous copy out of `buf` has finished
                buf[:n].copy_(src[start : start + n])
                with torch.cuda.stream(stream):
                    dst[start : start + n].copy_(buf[:n], non_blocking=True)
                    done.record(stream)
        done.synchronize()
    except BaseException as err:
        errors.append(err)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)
