"""Free TCP ports, chosen by the OS, for servers that must be told a port up front.

One implementation for every place that starts a server on a port it picks
itself: the stand-in pod, `igw demo`, the benchmarks and the tests. It lives
in picker because that is the lowest layer all of them may import (picker
imports none of igw, bench or tests).
"""

from __future__ import annotations

import socket


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct free ports (all bound at once while choosing, so none repeats)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free right now."""
    return free_ports(1, host)[0]
