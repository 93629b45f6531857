"""Attack injection for testing the robust receive rule (docs/design.md#byzantine-robust-receive-rule): an insider
that holds a valid identity and sends well-formed messages whose content is hostile. Never on by default: only a
:class:`~peer.sim.simulation.Simulation` given ``attacks``, bench/robust.py and the tests' attacker client use it.

An attack rewrites the messages an insider's honest engine produced (so it gossips on the fleet's schedule, with
its real seqs, weights and scales): the payload is decoded against the model layout, its values transformed, and
re-encoded dense in raw fp32 (the codec takes any payload form, so the attacker is not held to the fleet's
compression). The insider's own mass bookkeeping is of no concern: it is not honest.

Kinds:
    sign_flip   the update's values negated (SGP: the model -z; Choco and Deep-Squeeze: the step reversed)
    scale10     values times 10
    scale100    values times 100
    noise       Gaussian noise of ten times the values' own RMS added
    alie        "a little is enough" (Baruch, Baruch and Goldberg 2019): every message implies the insider's honest
                model shifted by ``z`` (:data:`ALIE_Z`) standard deviations of the honest peers' models, per
                coordinate, along one fixed random sign pattern - a consistent shift within the honest spread. The
                insider is
                omniscient, as in the paper: the simulator hands it the spread each round (:attr:`Attack.spread`).
                SGP and Deep-Squeeze: each message's mass carries the shift; Choco: the replica the receiver holds
                is kept at the shift (added once per edge, then only its change)
    shift       a consistent shift far outside the honest spread but within the rule's plausibility bound: half the
                values' RMS along one fixed random sign pattern, added to every message (what the table called
                "alie" before the spread-sized one)
    weight      the push-sum weight raised to just under the engine's hard bound (``max_peers`` x scale)
    huge        every value 1e30 (finite: it passes the codec and reaches the model unless the rule refuses it)
    nan         one value NaN (the codec refuses it; charged to the sender)
    sleeper     honest until ``start_round``, then scale100
    sink        sends nothing (its messages are dropped on the way out, its engine's books notwithstanding) while
                it receives and acknowledges everything: it drains the honest peers' push-sum mass unless they
                route around it (peer/gossip/sinks.py)
    slander     honest messages, and false quarantine notices (:attr:`Attack.slander` names the honest peers): it
                tells every peer, every ``NOTICE_EVERY`` rounds from its start, that it quarantined them - the
                abuse of docs/design.md#quarantine-notices (the receivers act only once every peer the named one
                sends to named it: insiders cut off only a peer that sends to insiders alone). Any other kind can
                add the same notices; an insider that is also quarantined has its notices ignored by its
                quarantiners.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field, replace
from statistics import NormalDist

import torch

from peer.compress.codec import CodecConfig, decode, encode
from peer.compress.layout import Layout
from peer.gossip.engine import OutMessage
from peer.gossip.ledger import DEFAULT_MAX_PEERS
from peer.gossip.robust import RobustConfig

ATTACKS = ("sign_flip", "scale10", "scale100", "noise", "alie", "shift", "weight", "huge", "nan", "sleeper", "sink",
           "slander")
#: The codec form an attacker re-encodes in: dense raw fp32 (any transformed value travels exactly).
RAW = CodecConfig(compression=0.0, bits=32)
#: Standard deviations of the honest models an ``alie`` insider shifts its model by, unless told otherwise
#: (:attr:`Attack.z`). The paper's z_max for 8 workers and one or two attackers is 0 to 0.32 (:func:`alie_z_max`);
#: 1 is stronger.
ALIE_Z = 1.0
#: Rounds between a slandering insider's false notices: as often as an honest quarantiner repeats its notice.
NOTICE_EVERY = RobustConfig().notice_every


def alie_z_max(workers: int, attackers: int) -> float:
    """The shift, in standard deviations, Baruch, Baruch and Goldberg (2019) give an ``alie`` attacker: the largest
    at which the attackers' value still sits nearer the mean than ``s`` honest workers' do, ``s = floor(workers / 2 +
    1) - attackers`` the honest supporters a majority needs, so ``z_max = Phi^-1((workers - s) / workers)``. 8 workers:
    0 with one attacker (no shift), 0.32 with two."""
    supporters = math.floor(workers / 2 + 1) - attackers
    if not 0 < supporters < workers:
        raise ValueError(f"alie_z_max: {attackers} attackers of {workers} workers leave no honest majority to hide in")
    return NormalDist().inv_cdf((workers - supporters) / workers)


@dataclass
class Attack:
    """One insider's attack.

    Attributes:
        kind: one of :data:`ATTACKS`.
        start_round: rounds before the attack starts (the insider is honest until then; ``sleeper`` is scale100
            from this round).
        max_peers: the receivers' hard weight bound factor (``weight``: claims just under ``scale * max_peers``).
        seed: seeds the noise and the sign pattern of ``alie`` and ``shift``.
        spread: ``alie`` only: the per-coordinate standard deviation of the honest peers' de-biased models, set by
            the caller before each round's messages are tampered with (a flat tensor of the model's size).
        slander: honest peers this insider names in false QuarantineNotices to every peer (:meth:`false_notice`);
            empty: it sends none.
        z: ``alie`` only: the shift in standard deviations of the honest models (:data:`ALIE_Z`; the paper's own
            strength: :func:`alie_z_max`).
    """

    kind: str
    start_round: int = 0
    max_peers: int = DEFAULT_MAX_PEERS
    seed: int = 0
    spread: torch.Tensor | None = field(default=None, repr=False)
    slander: tuple[str, ...] = ()
    z: float = ALIE_Z
    _signs: torch.Tensor | None = field(default=None, repr=False)
    _replica_shift: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in ATTACKS:
            raise ValueError(f"attack: unknown {self.kind!r}; choose one of {', '.join(ATTACKS)}")
        if self.kind == "sleeper" and self.start_round == 0:
            self.start_round = 20
        if not 0.0 <= self.z < math.inf:
            raise ValueError(f"attack: z must be a finite shift >= 0 standard deviations, got {self.z}")
        if self.kind == "slander" and not self.slander:
            raise ValueError("attack slander: name the honest peers its false notices name (Attack.slander)")
        self._generator = torch.Generator().manual_seed(self.seed)

    def active(self, round_index: int) -> bool:
        return round_index >= self.start_round

    def false_notice(self, round_index: int) -> list[str] | None:
        """The honest peers a false notice names in ``round_index``, or None when none is due (at the attack's
        start and every :data:`NOTICE_EVERY` rounds after)."""
        if not self.slander or not self.active(round_index):
            return None
        return sorted(self.slander) if (round_index - self.start_round) % NOTICE_EVERY == 0 else None

    @property
    def needs_spread(self) -> bool:
        """Whether the caller must set :attr:`spread` before tampering (``alie``)."""
        return self.kind == "alie"

    def tamper(self, message: OutMessage, layout: Layout, replicated: bool = False) -> OutMessage | None:
        """The hostile version of an honest ``message`` (the same one before :attr:`start_round`; None: dropped,
        never sent). ``replicated``: the algorithm adds payloads to a per-edge replica (Choco), so ``alie`` sends
        the change of its shift, not the whole shift, each time."""
        if not self.active(message.round) or self.kind == "slander":
            return message
        if self.kind == "sink":
            return None
        if self.kind == "weight":
            return replace(message, weight=message.scale * self.max_peers * 0.999)
        values = decode(message.payload, layout).to_dense(layout.numel)
        if self.kind == "alie":
            return replace(message, payload=encode(self._shifted(values, message, replicated), layout, RAW)[0])
        if self.kind == "nan":
            payload, _ = encode(values, layout, RAW)
            return replace(message, payload=payload[:-4] + struct.pack("<f", float("nan")))
        return replace(message, payload=encode(self.transform(values), layout, RAW)[0])

    def transform(self, values: torch.Tensor) -> torch.Tensor:
        """The hostile values of a dense update (a new tensor)."""
        rms = float(values.pow(2).mean().sqrt())
        if self.kind == "sign_flip":
            return -values
        if self.kind in ("scale10", "scale100", "sleeper"):
            return values * (10.0 if self.kind == "scale10" else 100.0)
        if self.kind == "noise":
            return values + 10.0 * rms * torch.randn(values.shape, generator=self._generator)
        if self.kind == "shift":
            return values + 0.5 * rms * self._sign_pattern(values.numel())
        if self.kind == "huge":
            return torch.full_like(values, 1e30)
        raise AssertionError(self.kind)

    def _sign_pattern(self, numel: int) -> torch.Tensor:
        """One fixed random +-1 per coordinate (drawn once from the attack's seed)."""
        if self._signs is None or self._signs.numel() != numel:
            self._signs = torch.randint(0, 2, (numel,), generator=self._generator).float() * 2 - 1
        return self._signs

    def _shifted(self, values: torch.Tensor, message: OutMessage, replicated: bool) -> torch.Tensor:
        """``alie``: the values of a message implying the sender's model + :attr:`z` * spread * signs."""
        if self.spread is None or self.spread.numel() != values.numel():
            raise ValueError("attack alie: needs the honest peers' spread (Attack.spread, one value per "
                             "coordinate), which the simulator sets each round")
        shift = self.z * self.spread.to(values.dtype) * self._sign_pattern(values.numel())
        if replicated:  # the receiver's replica keeps what was added: send only the shift's change on this edge
            before = self._replica_shift.get(message.receiver)
            self._replica_shift[message.receiver] = shift
            return values + (shift if before is None else shift - before)
        # the receiver takes scale * values as mass with weight ``weight``: its implied model moves by the shift
        return values + shift * (message.weight / message.scale)
