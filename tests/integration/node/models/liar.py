"""A model that breaks the node's frame protocol from inside its instance, as a hostile model could: asked to, it
finds its instance's connection to the node and writes a frame header that announces a payload of `length` bytes
(`cmd` b"frame:OP:LENGTH"), then sends none of it and waits. Anything else is answered plainly (y = x)."""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np


def node_connection() -> socket.socket:
    """The instance's connected Unix stream socket (its listener is the other one)."""
    for fd in sorted(int(n) for n in os.listdir("/proc/self/fd")):
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        if (sock.family == socket.AF_UNIX and sock.type == socket.SOCK_STREAM
                and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
            return sock
        sock.close()
    raise RuntimeError("liar: no connection to the node found")


class Liar:
    def load(self, weights: Path | None, options: dict[str, Any]) -> None:
        pass

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        cmd = bytes(inputs["cmd"].reshape(-1)[0])
        if cmd.startswith(b"frame:"):
            op, length = cmd[6:].decode().split(":")
            header = json.dumps({"op": op, "id": 0}).encode()
            node_connection().sendall(struct.pack("<II", len(header), int(length)) + header)
            time.sleep(600)   # the payload never comes: a node that waits for it waits here
        return {"y": inputs["x"].astype(np.float32)}
