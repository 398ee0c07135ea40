"""Gateway codec cost: V2 JSON vs the binary tensor extension, parse + encode, per request.

Prints a table and writes bench/results/gateway_codec.json. Figures are per-request times in
one run and the JSON/binary ratio; they compare the two encodings, not machines.

    python bench/gateway_codec.py [--repeat 50]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ember.gateway.v2_codec import encode_infer_response, parse_infer
from ember.wire.contract import parse_contract
from ember.wire.tensors import to_raw

CONTRACT = parse_contract({
    "name": "m", "runtime": "python", "entrypoint": "a:B",
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, -1]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, -1]}],
})


def request(x: np.ndarray, binary: bool) -> tuple[bytes, str | None]:
    spec: dict[str, Any] = {"name": "x", "shape": list(x.shape), "datatype": "FP32"}
    out = {"name": "y", "parameters": {"binary_data": binary}}
    if not binary:
        return json.dumps({"inputs": [{**spec, "data": x.ravel().tolist()}], "outputs": [out]}).encode(), None
    raw = to_raw(x)
    head = json.dumps({"inputs": [{**spec, "parameters": {"binary_data_size": len(raw)}}], "outputs": [out]}).encode()
    return head + raw, str(len(head))


def round_trip(body: bytes, header: str | None) -> bytes:
    """What the gateway does around the model: parse the request, encode the response (y = x)."""
    parsed = parse_infer(body, header, CONTRACT)
    return encode_infer_response(CONTRACT, parsed, {"y": parsed.inputs["x"]})[0]


def per_call(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(repeat: int) -> list[dict[str, Any]]:
    rows = []
    for rows_, cols in ((32, 384), (256, 1024)):
        x = np.random.default_rng(0).standard_normal((rows_, cols)).astype(np.float32)
        row: dict[str, Any] = {"tensor": f"FP32 [{rows_}, {cols}]"}
        for mode in ("json", "binary"):
            body, header = request(x, mode == "binary")
            row[f"{mode}_bytes"] = len(body)
            row[f"{mode}_ms"] = 1000 * per_call(functools.partial(round_trip, body, header), repeat)
        row["json_over_binary"] = row["json_ms"] / row["binary_ms"]
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=50)
    rows = run(parser.parse_args().repeat)
    print(f"{'tensor':<18}{'json bytes':>12}{'json ms':>10}{'binary bytes':>14}{'binary ms':>11}{'json/binary':>13}")
    for r in rows:
        print(f"{r['tensor']:<18}{r['json_bytes']:>12}{r['json_ms']:>10.3f}{r['binary_bytes']:>14}"
              f"{r['binary_ms']:>11.3f}{r['json_over_binary']:>13.1f}")
    out = Path(__file__).resolve().parent / "results" / "gateway_codec.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
