"""A compromised fleet device for the insider tests: the project's own daemon (``lpdl-peer start``, unchanged) whose
outgoing updates are rewritten by the attacks of peer/sim/attacks.py on their way to the wire.

    python tests/attacker_daemon.py --attack sign_flip --attack scale10 --from-round 8 -- \
        start --state-dir DIR --peer-id peer-003 --fleet default ...

Which and why: the daemon itself, not a hand-written client. Everything around the payload is the real thing - the
certificate issued by the fleet CA, mutual TLS, Identify and GetModel, the Hello handshake, per-edge seqs, acks,
retractions, rounds on the fleet's schedule and the push-sum books - so the honest daemons meet exactly what a
device taken over by someone who can only change what it says would send. A hand-written client would have to
re-implement the ledger to keep valid push-sum bookkeeping, and whatever it got wrong would be a second attacker
the test did not mean.

How: the daemon hands every committed message to ``GrpcTransport.submit``; this entry point replaces the transport
class the node module builds with :class:`TamperingTransport`, whose submit passes each message through the attacks
first (in the order given: sign_flip then scale10 sends -10 times the honest values). The engine subtracted the
honest message's mass and weight, so the attacker's own books are those of an honest peer: the attacks used here
rewrite payloads, never weights, which is what lets a test count the fleet's weight over all four checkpoints.
Each tampered message is logged (``attacker: tampered update``), so a test can see the attack really went out.

Test-only: nothing in peer/ imports this module and no flag or config field of the shipped daemon reaches it.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout root, not tests/, is where ``peer`` lives
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import peer.daemon.node as node  # noqa: E402
from peer.cli import main as entry  # noqa: E402
from peer.gossip.engine import OutMessage  # noqa: E402
from peer.net.transport import GrpcTransport  # noqa: E402
from peer.sim.attacks import ATTACKS, Attack  # noqa: E402

log = logging.getLogger("attacker")

#: The log line a test looks for: one per tampered update.
TAMPERED = "attacker: tampered update"


class TamperingTransport(GrpcTransport):
    """The daemon's edge table, with every outgoing update rewritten by :attr:`attacks` (set before the node
    starts) from the round each attack starts at (before it: sent unchanged, the sleeper's honest phase)."""

    attacks: Sequence[Attack] = ()

    def submit(self, messages: Sequence[OutMessage]) -> None:
        layout = self.gate.peer.flat.layout  # type: ignore[attr-defined]  # the daemon's PeerGate holds the peer
        hostile = []
        for message in messages:
            tampered: OutMessage | None = message
            for attack in self.attacks:
                tampered = attack.tamper(tampered, layout) if tampered is not None else None
            if tampered is not message:
                log.info("%s seq %d to %s (round %d: %s)", TAMPERED, message.seq, message.receiver, message.round,
                         "+".join(a.kind for a in self.attacks if a.active(message.round)))
            if tampered is not None:
                hostile.append(tampered)
        super().submit(hostile)


def parse(argv: Sequence[str]) -> tuple[list[Attack], list[str]]:
    """The attacks, and the ``lpdl-peer`` arguments after ``--``."""
    parser = argparse.ArgumentParser(prog="attacker_daemon.py",
                                     description="lpdl-peer start with its outgoing updates tampered (tests only)")
    # "a little is enough" needs the honest peers' spread, which only the simulator knows; "slander" is in notices,
    # which only the simulator forges
    parser.add_argument("--attack", action="append", choices=[a for a in ATTACKS if a not in ("alie", "slander")],
                        required=True,
                        help="attack applied to every outgoing update, in the order given (repeatable)")
    parser.add_argument("--from-round", type=int, default=0,
                        help="round the attacks start at; the updates of earlier rounds go out unchanged")
    args_list = list(argv)
    cut = args_list.index("--") if "--" in args_list else len(args_list)
    args = parser.parse_args(args_list[:cut])
    if cut == len(args_list):
        parser.error("give the lpdl-peer arguments after --")
    attacks = [Attack(kind, start_round=args.from_round) for kind in args.attack]
    return attacks, args_list[cut + 1:]


def main(argv: Sequence[str]) -> None:
    attacks, daemon_args = parse(argv)
    TamperingTransport.attacks = attacks
    node.GrpcTransport = TamperingTransport  # type: ignore[attr-defined]  # the node builds its transport by this name
    sys.argv = ["lpdl-peer", *daemon_args]
    entry.main()


if __name__ == "__main__":
    main(sys.argv[1:])
