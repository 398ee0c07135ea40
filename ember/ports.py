"""Ports on this machine: a free one to listen on."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port no socket holds on `host` now (the kernel's pick; taken by whoever binds it first)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
