"""Free TCP ports, chosen by the OS, for servers that must be told a port up front.

`igw up` picks every port of its demo fleet and gateway this way; the benchmarks
and the tests start their servers on ports chosen here too. It lives in igw, the
layer of its product user (bench and tests may import igw; picker never needs a
free port).
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
