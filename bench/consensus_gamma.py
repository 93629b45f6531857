"""Pure consensus (no training) of n peers (8 by default) with the real mnist-cnn layout: is a gamma stable at 99% top-k?

Every peer starts from a different random model (the model's own initialisation, seeds 100+), then only gossips:
the daemon's engines over the simulator's in-memory transport, no gradient step. A stable gamma shrinks the
consensus distance mean_i ||z_i - z_bar|| towards 0; an unstable one lets Choco's replica gap grow until it does
not. A daemon keeps gossiping after training ends (at 1% of the lr), so a default gamma must pass this for many
rounds, not only the 160-320 rounds of a 10-20 epoch simulation.

    python bench/consensus_gamma.py --rounds 1500 ring:0.02 ring:0.05 ring-rotating:0.05 exponential-rotating:0.05
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from peer.compress.codec import CodecConfig
from peer.gossip.engine import GossipEngine
from peer.gossip.topology import Topology, spectral_gap
from peer.lowp.precision import PrecisionConfig
from peer.models import build_model
from peer.runtime import state
from peer.runtime.flat import FlatModel
from peer.sim.transport import InMemoryTransport
from tests.gossip_helpers import endpoints


def run(kind: str, rotating: bool, gamma: float, rounds: int, algorithm: str, compression: float,
        checkpoints: tuple[int, ...], n: int = 8) -> dict:
    engines = {}
    replica_init = None
    for r in range(n):
        torch.manual_seed(100 + r)
        model = build_model("mnist-cnn", num_classes=10, in_channels=1, norm="range-evonorm",
                            precision=PrecisionConfig(mode="fp32"))
        flat = FlatModel(model)
        if replica_init is None:
            replica_init = flat.z.clone()  # a common start for the replicas, as the fleet's initial model
        engines[f"p{r}"] = GossipEngine(f"p{r}", flat.layout, flat.z.clone(), algorithm,
                                        CodecConfig(compression=compression, bits=8), gamma=gamma, window=4,
                                        seed=r, replica_init=replica_init)
    topology = Topology(kind, rotating, 2, 0)
    transport = InMemoryTransport(endpoints(engines))
    ids = sorted(engines)

    def distance() -> float:
        return state.consensus_distance([e.state.debiased() for e in engines.values()])

    start = distance()
    curve = {0: 1.0}
    t0 = time.perf_counter()
    for t in range(rounds):
        transport.begin_round(t)
        for peer in ids:
            out = topology.out_neighbours(ids, peer, t)
            transport.submit(engines[peer].send_round(out, t, transport.ready(peer, out)))
        transport.deliver(t)
        if t + 1 in checkpoints:
            d = distance()
            curve[t + 1] = d / start
            if not math.isfinite(d) or d > 10 * start:
                break
    return {"topology": kind + (" rotating" if rotating else ""), "gamma": gamma, "algorithm": algorithm,
            "peers": n, "gap": spectral_gap(topology, n), "relative_distance": curve, "wall_s": time.perf_counter() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", nargs="+", help="topology[-rotating]:gamma, e.g. ring:0.05 ring-rotating:0.1")
    p.add_argument("--rounds", type=int, default=1500)
    p.add_argument("--peers", type=int, default=8)
    p.add_argument("--algorithm", default="choco")
    p.add_argument("--compression", type=float, default=0.99)
    p.add_argument("--out", type=Path, default=None, help="Append one JSON line per case here.")
    args = p.parse_args()
    torch.set_num_threads(1)
    checkpoints = tuple(c for c in (50, 100, 200, 400, 800, 1500, 3000, 6000) if c <= args.rounds)
    for case in args.cases:
        topo, _, gamma = case.partition(":")
        rotating = topo.endswith("-rotating")
        kind = topo.removesuffix("-rotating")
        res = run(kind, rotating, float(gamma), args.rounds, args.algorithm, args.compression, checkpoints,
                  args.peers)
        line = json.dumps(res)
        print(line, flush=True)
        if args.out:
            with args.out.open("a") as fh:
                fh.write(line + "\n")


if __name__ == "__main__":
    main()
