"""An 8-peer fleet in network namespaces: how fast mDNS finds everyone, and whether one slow link holds others back.

Builds the testbed of deploy/netns-testbed.sh (one namespace per host on one bridge, real zeroconf mDNS, real gRPC),
starts one ``lpdl-peer start --neighbors auto`` per host, and reads every peer's control socket:

    discovery     seconds from the moment the LAST peer answered its control socket (it is serving and has
                  registered on mDNS) until EVERY peer lists all the others as live neighbours (goal < 3 s);
                  also from the last process start (includes torch import and the int8 probe)
    slow link     median round time (ms) of the peers whose own links are uncapped, first with every link free,
                  then with host 0's egress capped by tc tbf (default 1 Mbit/s); ratio capped / free (a slow edge
                  should not hold the fleet back: the window and per-edge streams keep other edges going)

Needs root, iproute2 and nftables (the testbed's requirements). Usage:
    python bench/netns_fleet.py [--peers 8] [--cap 1mbit] [--measure-s 30] [-- extra lpdl-peer start args]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from peer.daemon.control import read_control_socket
from peer.daemon.paths import CONTROL_SOCKET_NAME

REPO = Path(__file__).resolve().parents[1]
TESTBED = REPO / "deploy" / "netns-testbed.sh"
#: Daemon flags of the bench fleet: a small model, one thread each, training for as long as the bench runs.
FLEET_ARGS = ["--model", "mnist-cnn", "--threads", "1", "--epochs", "1000", "--eval-every", "100000"]


def testbed(env: dict[str, str], *args: str) -> None:
    """Run one deploy/netns-testbed.sh command (raises with its output on failure)."""
    proc = subprocess.run([str(TESTBED), *args], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"netns-testbed.sh {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}")


async def snapshot(sock: Path) -> dict[str, Any] | None:
    """A peer's status document, or None while it does not answer."""
    try:
        return await asyncio.wait_for(read_control_socket(sock), 2.0)
    except (OSError, asyncio.TimeoutError, ValueError):
        return None


async def wait_discovery(socks: list[Path], timeout_s: float) -> tuple[float, float]:
    """(monotonic time the last peer first answered, monotonic time every peer saw every other one as live)."""
    first_answer: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        docs = await asyncio.gather(*(snapshot(s) for s in socks))
        now = time.monotonic()
        for i, doc in enumerate(docs):
            if doc is not None and i not in first_answer:
                first_answer[i] = now
        if len(first_answer) == len(socks) and all(
                doc is not None and sum(n["live"] for n in doc["neighbours"].values()) == len(socks) - 1
                for doc in docs):
            return max(first_answer.values()), now
        await asyncio.sleep(0.05)
    raise TimeoutError(f"not every peer saw the full neighbour set within {timeout_s:.0f} s")


async def round_times(socks: list[Path], seconds: float) -> dict[int, list[float]]:
    """Every distinct round's last_round_s per peer (seconds), polled for ``seconds``."""
    seen: dict[int, dict[int, float]] = {i: {} for i in range(len(socks))}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for i, doc in enumerate(await asyncio.gather(*(snapshot(s) for s in socks))):
            if doc is not None and doc["last_round_s"]:
                seen[i][doc["round"]] = doc["last_round_s"]
        await asyncio.sleep(0.2)
    return {i: list(rounds.values()) for i, rounds in seen.items()}


async def sent_bytes(sock: Path) -> int:
    """Bytes a peer has sent over all its links so far."""
    doc = await snapshot(sock)
    return 0 if doc is None else sum(n["bytes_sent"] for n in doc["neighbours"].values())


async def phase(socks: list[Path], seconds: float) -> tuple[dict[int, list[float]], float]:
    """Round times of every peer over ``seconds``, and host 0's send rate meanwhile (kbit/s)."""
    before, t0 = await sent_bytes(socks[0]), time.monotonic()
    samples = await round_times(socks, seconds)
    rate = (await sent_bytes(socks[0]) - before) * 8 / 1000 / (time.monotonic() - t0)
    return samples, rate


def median_ms(samples: dict[int, list[float]], peers: list[int]) -> float:
    values = [statistics.median(samples[i]) for i in peers if samples[i]]
    return statistics.median(values) * 1000 if values else float("nan")


async def bench(args: argparse.Namespace, env: dict[str, str], run_dir: Path) -> None:
    socks = [run_dir / "state" / f"h{i}" / CONTROL_SOCKET_NAME for i in range(args.peers)]
    started = time.monotonic()
    testbed(env, "fleet", str(args.peers), *FLEET_ARGS, *args.extra)
    spawned = time.monotonic()
    last_ready, full = await wait_discovery(socks, args.timeout_s)
    print(f"discovery: every peer saw all {args.peers - 1} others {full - last_ready:.2f} s (poll: 0.05 s + one "
          f"status read per peer) after the last peer "
          f"answered ({full - spawned:.1f} s after the last process start, {full - started:.1f} s after the first)")
    others = list(range(1, args.peers))
    free, free_kbps = await phase(socks, args.measure_s)
    testbed(env, "cap", "0", args.cap)
    capped, capped_kbps = await phase(socks, args.measure_s)
    testbed(env, "uncap", "0")
    free_ms, capped_ms = median_ms(free, others), median_ms(capped, others)
    print(f"round time of hosts 1..{args.peers - 1} (median of per-peer medians): {free_ms:.0f} ms with every link "
          f"free, {capped_ms:.0f} ms with host 0 capped to {args.cap}: ratio {capped_ms / free_ms:.2f}x")
    print(f"host 0 itself: {median_ms(free, [0]):.0f} ms free, {median_ms(capped, [0]):.0f} ms capped; it sent "
          f"{free_kbps:.0f} kbit/s free, {capped_kbps:.0f} kbit/s capped")
    rss = [doc["memory"]["peak_mib"] for doc in await asyncio.gather(*(snapshot(s) for s in socks))
           if doc is not None and doc.get("memory")]
    if rss:
        print(f"daemon peak RSS: median {statistics.median(rss):.0f} MiB, max {max(rss):.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--cap", default="1mbit", help="tc tbf rate of host 0's egress in the slow-link phase")
    parser.add_argument("--measure-s", type=float, default=30.0, help="seconds each round-time phase is sampled")
    parser.add_argument("--timeout-s", type=float, default=240.0, help="seconds to wait for full discovery")
    parser.add_argument("extra", nargs="*", help="more `lpdl-peer start` flags for every peer (after --)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/netns_fleet.py needs root (network namespaces)")
    run_dir = Path(tempfile.mkdtemp(prefix="lpdl-netns-bench-"))
    env = {**os.environ, "LPNS_PREFIX": "lpb", "LPNS_SUBNET": "10.214.0", "LPNS_DIR": str(run_dir),
           "LPDL_BIN": str(Path(sys.executable).with_name("lpdl-peer"))}
    try:
        asyncio.run(bench(args, env, run_dir))
    finally:
        subprocess.run([str(TESTBED), "stop", "20"], env=env, capture_output=True)
        subprocess.run([str(TESTBED), "down"], env=env, capture_output=True)
        print(f"logs and state: {run_dir}")


if __name__ == "__main__":
    main()
