"""gRPC's own C-core log lines stay off the terminal unless the project logs at DEBUG (peer/logs.py).

The scenario makes the client's core log ``chttp2_transport.cc ... Got goaway`` (INFO) every time: a server that
bears one ping strike and a client that pings every 100 ms, so the server closes the connection with GOAWAY
ENHANCE_YOUR_CALM ("too many pings", about 3 s in). The core also logs that GOAWAY at ERROR, which stays visible.
Each run is a fresh interpreter, because gRPC reads its threshold once per process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: argv[1]: "none" (no set-up) or the --log-level the CLI would pass to setup_logging.
GOAWAY = """
import asyncio, sys
if sys.argv[1] != "none":
    from peer.logs import setup_logging
    setup_logging(sys.argv[1])
import grpc

async def slow(request, context):
    await asyncio.sleep(10)
    return b""

async def main():
    server = grpc.aio.server(options=[("grpc.http2.max_ping_strikes", 1),
                                      ("grpc.http2.min_recv_ping_interval_without_data_ms", 60000)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t.T", {"Slow": grpc.unary_unary_rpc_method_handler(slow)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    pings = [("grpc.keepalive_time_ms", 100), ("grpc.keepalive_permit_without_calls", 1),
             ("grpc.http2.max_pings_without_data", 0)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=pings) as channel:
        try:
            await channel.unary_unary("/t.T/Slow")(b"", timeout=10)
        except grpc.aio.AioRpcError as exc:
            print("client:", exc.code().name, exc.details())
    await server.stop(0)

asyncio.run(main())
"""


def goaway_stderr(setup: str) -> str:
    """stderr of the GOAWAY scenario run with ``setup`` (GRPC_VERBOSITY not inherited from this process)."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run([sys.executable, "-c", GOAWAY, setup], capture_output=True, text=True, timeout=60,
                          env=env, check=False)
    assert "client: UNAVAILABLE Too many pings" in proc.stdout, proc.stdout + proc.stderr
    return proc.stderr


def test_the_scenario_makes_grpc_core_log_goaway_without_set_up() -> None:
    """Control: without the set-up the core's line does land on stderr (else the next test proves nothing)."""
    assert "Got goaway" in goaway_stderr("none")


def test_grpc_core_info_lines_are_silenced_below_debug() -> None:
    stderr = goaway_stderr("INFO")
    assert "Got goaway" not in stderr, stderr


def test_debug_lets_grpc_core_lines_through() -> None:
    assert "Got goaway" in goaway_stderr("DEBUG")
