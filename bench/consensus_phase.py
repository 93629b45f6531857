"""The consensus phase's contenders from one trained fleet, side by side: accuracy of the averaged model and of the
mean device model after each phase round, the phase's bytes over the training run's bytes.

The 8-peer simulator trains once (skew 0.9 by default) and keeps every peer's engine state at the end of training
(``--state``, reused when it exists); each contender then runs the final phase from that same state in a fresh
simulation, so the contenders differ only in the phase. A contender is ``compression:gamma:tolerance`` with an
optional ``:bits`` (the phase's value width; default the training's), ``:step_floor`` (its grid's coarsest step,
``gossip.consensus_step_floor``; default the tolerance, ``::0`` the plain grid) and ``:probe`` (1: probe rounds past the
horizon, ``gossip.consensus_probe``; 0: every round dense; default the config's, off) and ``:budget`` (the phase's
bytes over the training's past which confirming rounds are probes, ``gossip.consensus_budget``; 0: none; default the
config's, 2), e.g. ``0:1:0.01`` (dense at gamma 1 to 0.01), ``0:1:0.02:::1`` (to 0.02 with probes),
``0:1:0.02::::0`` (every round dense, no budget).

    python bench/consensus_phase.py --state runs/phase-state.pt 0:1:0.01 0:1:0.1 0.9:0.5:0.1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from peer.config import DataSpec, GossipSpec, ModelSpec, OptimSpec, RunSpec
from peer.gossip.consensus import PhaseName
from peer.runtime.build import load_splits
from peer.runtime.consensus import begin_phase
from peer.runtime.evaluation import evaluate
from peer.sim.simulation import EpochRow, Simulation


@dataclasses.dataclass(frozen=True)
class Contender:
    """One phase: its top-k compression, gamma, tolerance and value bits (None: the training's)."""

    compression: float
    gamma: float
    tolerance: float
    bits: int | None = None
    step_floor: float | None = None
    probe: bool | None = None
    budget: float | None = None

    @classmethod
    def parse(cls, text: str) -> Contender:
        parts = text.split(":")
        if len(parts) not in (3, 4, 5, 6, 7) or (len(parts) >= 6 and parts[5] not in ("", "0", "1")):
            raise argparse.ArgumentTypeError(f"contender {text!r}: expected "
                                             "compression:gamma:tolerance[:bits[:step_floor[:probe 0|1[:budget]]]]")
        bits = int(parts[3]) if len(parts) >= 4 and parts[3] else None
        return cls(float(parts[0]), float(parts[1]), float(parts[2]), bits,
                   float(parts[4]) if len(parts) >= 5 and parts[4] else None,
                   None if len(parts) < 6 or not parts[5] else parts[5] == "1",
                   float(parts[6]) if len(parts) == 7 and parts[6] else None)

    def __str__(self) -> str:
        return (f"c={self.compression:g} gamma={self.gamma:g} tol={self.tolerance:g}"
                + (f" {self.bits}-bit" if self.bits is not None else "")
                + (f" floor={self.step_floor:g}" if self.step_floor is not None else "")
                + ({None: "", True: " probes", False: " no probes"}[self.probe])
                + (f" budget={self.budget:g}x" if self.budget is not None else ""))


def run_spec(args: argparse.Namespace, contender: Contender | None) -> RunSpec:
    gossip = GossipSpec(compression=args.compression, bits=args.bits)
    if contender is not None:
        gossip = dataclasses.replace(gossip, consensus_rounds=args.max_rounds, consensus_tolerance=contender.tolerance,
                                     consensus_patience=args.patience, consensus_compression=contender.compression,
                                     consensus_gamma=contender.gamma)
        if contender.probe is not None:
            gossip = dataclasses.replace(gossip, consensus_probe=contender.probe)
        if contender.budget is not None:
            gossip = dataclasses.replace(gossip, consensus_budget=contender.budget)
        if contender.step_floor is not None:
            gossip = dataclasses.replace(gossip, consensus_step_floor=contender.step_floor)
    return RunSpec(model=ModelSpec(precision=args.precision), data=DataSpec(skew=args.skew, seed=args.seed),
                   optim=OptimSpec(epochs=args.epochs), gossip=gossip)


def train(args: argparse.Namespace) -> dict:
    """Train the fleet once; what every contender starts from."""
    spec = run_spec(args, None)
    sim = Simulation(spec, load_splits(spec.data), args.peers)
    rows = sim.run(args.epochs, on_row=lambda r: print(f"  training epoch {r.epoch:.2f}: averaged "
                                                        f"{r.avg_model_acc:.2%}, mean device {r.mean_peer_acc:.2%}",
                                                        flush=True))
    return {"engines": {p: peer.engine.state_dict() for p, peer in sim.peers.items()},
            "buffers": {p: dict(peer.model.named_buffers()) for p, peer in sim.peers.items()},
            "steps": {p: peer.steps for p, peer in sim.peers.items()},
            "round": sim.round,
            "train_bytes": {p: sim.transport.bytes_sent(p) for p in sim.peers},
            "row": rows[-1].as_dict()}


def phase(args: argparse.Namespace, trained: dict, contender: Contender) -> dict:
    """One contender's final phase from the trained state, measured after every round."""
    spec = run_spec(args, contender)
    if contender.bits is not None:
        spec = dataclasses.replace(spec, gossip=dataclasses.replace(spec.gossip, bits=contender.bits))
    sim = Simulation(spec, load_splits(spec.data), args.peers)
    for p, peer in sim.peers.items():
        peer.engine.load_state_dict(trained["engines"][p])
        with torch.no_grad():
            for name, buf in peer.model.named_buffers():
                buf.copy_(trained["buffers"][p][name])
        peer.steps = trained["steps"][p]
        peer.sync_model()
    sim.round = trained["round"]
    for p, peer in sim.peers.items():
        # what the phase's byte budget is relative to: here the links' bytes, payloads plus their framing (a daemon
        # counts the payloads alone), as the bench's ratio column does
        peer.training_bytes = trained["train_bytes"][p]
        begin_phase(peer, final=True)
    curve = [_point(sim, 0)]
    train_bytes = sum(trained["train_bytes"].values()) / len(trained["train_bytes"])
    rounds = 0
    while rounds < 2 * args.max_rounds and any(p.phase is not PhaseName.CONVERGED for p in sim.peers.values()):
        sim.step_round()
        rounds += 1
        curve.append(_point(sim, rounds))
        c = curve[-1]
        print(f"  {contender}  round {rounds:3d}: averaged {c['avg']:.2%} mean device {c['mean']:.2%} "
              f"worst {c['worst']:.2%}, max distance to average {c['rel']:.4f}, bytes {c['bytes'] / train_bytes:.2f}x",
              flush=True)
    done = [peer.consensus_done[-1] for peer in sim.peers.values() if peer.consensus_done]
    ends = {"rounds": [d.rounds for d in done], "probes": [d.probes for d in done],
            "ended": [d.ended.value if d.ended else None for d in done]}
    print(f"  {contender}  phase rounds per peer {ends['rounds']}, of them probes {ends['probes']}, ended "
          f"{sorted(set(map(str, ends['ended'])))}", flush=True)
    return {"contender": str(contender), "rounds": rounds, "curve": curve, "train_bytes_per_peer": train_bytes,
            **ends}


def _point(sim: Simulation, rounds: int) -> dict:
    row: EpochRow = sim.measure(math.nan, 0.0)
    peers = list(sim.peers.values())
    zs = [p.flat.z for p in peers]
    avg = torch.stack(zs).mean(dim=0)
    rel = max(float((z - avg).norm()) for z in zs) / float(avg.norm())
    accs = [evaluate(p.model, sim.test_batches)[1] for p in peers]
    return {"round": rounds, "avg": row.avg_model_acc, "mean": row.mean_peer_acc, "worst": min(accs), "rel": rel,
            "bytes": sum(sim.transport.bytes_sent(p) for p in sim.peers) / len(peers)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("contenders", nargs="+", type=Contender.parse)
    ap.add_argument("--state", type=Path, required=True, help="the trained fleet (written on the first run)")
    ap.add_argument("--peers", type=int, default=8)
    ap.add_argument("--skew", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0, help="the run's seed (data.seed: shards, model, batches)")
    ap.add_argument("--epochs", type=float, default=3.0)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--compression", type=float, default=0.99)
    ap.add_argument("--bits", type=int, default=8)
    ap.add_argument("--max-rounds", type=int, default=40)
    ap.add_argument("--patience", type=int, default=GossipSpec().consensus_patience)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.state.exists():
        trained = torch.load(args.state, weights_only=False)
    else:
        trained = train(args)
        args.state.parent.mkdir(parents=True, exist_ok=True)
        torch.save(trained, args.state)
    results = [phase(args, trained, c) for c in args.contenders]
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
