"""An outsider's connection flood, run inside a testbed host: plain TCP connections to a daemon's port that never
speak (no TLS ClientHello). Prints one JSON line of what it got.

    python -m tests.conn_flood HOST PORT hold N SECONDS   keep N connections open for SECONDS, reopening each one the
                                                          server closes; reports the most established at once
    python -m tests.conn_flood HOST PORT churn N          open and close N connections back to back; reports how
                                                          many were refused
"""

from __future__ import annotations

import json
import socket
import sys
import time

#: Seconds one connect may take (a reset answers at once; a dropped SYN would wait).
CONNECT_TIMEOUT_S = 2.0


def connect(host: str, port: int) -> socket.socket | None:
    """An established connection, or None if it was refused or timed out."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(CONNECT_TIMEOUT_S)
    try:
        sock.connect((host, port))
    except OSError:
        sock.close()
        return None
    sock.setblocking(False)
    return sock


def is_open(sock: socket.socket) -> bool:
    """False once the server closed (or reset) the connection."""
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def hold(host: str, port: int, n: int, seconds: float) -> dict[str, int]:
    """Keep up to ``n`` connections open, reopening closed ones, for ``seconds``."""
    held: list[socket.socket] = []
    most = attempts = refused = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = [s for s in held if is_open(s)]
        for s in set(held) - set(alive):
            s.close()
        held = alive
        while len(held) < n and time.monotonic() < deadline:
            attempts += 1
            sock = connect(host, port)
            if sock is None:
                refused += 1
                break  # refused now: look at what is still open, then try again
            held.append(sock)
        most = max(most, sum(is_open(s) for s in held))
        time.sleep(0.05)
    for s in held:
        s.close()
    return {"most_open": most, "attempts": attempts, "refused": refused}


def churn(host: str, port: int, n: int) -> dict[str, int]:
    """Open and close ``n`` connections back to back."""
    refused = 0
    for _ in range(n):
        sock = connect(host, port)
        if sock is None:
            refused += 1
        else:
            sock.close()
    return {"attempts": n, "refused": refused}


def main(argv: list[str]) -> None:
    host, port, mode = argv[0], int(argv[1]), argv[2]
    result = hold(host, port, int(argv[3]), float(argv[4])) if mode == "hold" else churn(host, port, int(argv[3]))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
