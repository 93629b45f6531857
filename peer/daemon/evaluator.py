"""The daemon's own test evaluations, spread over its rounds instead of stopping them.

Why: an evaluation of mnist5k's 1,000 test images took a README fleet daemon 0.6-1.0 s (four daemons on two cores),
about ten of its neighbours' rounds, and its rounds stopped meanwhile: it sent nothing and applied nothing, while
its neighbours went on sending it their push-sum shares. Their weights drained to w ~ 0 and the evaluating daemon
came back holding nearly all of the fleet's mass (w 3.3-4.0 of 4, sampled every 0.2 s), the mixing of dense SGP
lost for that time. Now the daemon snapshots its de-biased model into a second copy of the model when an evaluation
is due and evaluates :data:`BATCHES_PER_ROUND` batches of it after each round, on the same worker thread (a second
thread would keep a malloc arena and tensor caches of its own): 8 rounds of 4 batches for the README fleet, each
round about one training step longer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import Tensor, nn

from peer.daemon.status import EvalResult
from peer.runtime.evaluation import Evaluation
from peer.runtime.peer import Peer

#: Test batches evaluated after each round while an evaluation runs: about one training step's time (a batch's
#: forward is about a third of a step's forward and backward). Fewer spread it over more rounds (its result comes
#: later); more make each of those rounds longer.
BATCHES_PER_ROUND = 4


@dataclass(frozen=True)
class _Running:
    """An evaluation under way, and what its snapshot was taken at."""

    evaluation: Evaluation
    round: int
    epoch: float
    train_loss: float
    w: float


@dataclass(frozen=True)
class Finished:
    """A finished evaluation: its result, and the training loss and push-sum weight at its snapshot (for the log)."""

    result: EvalResult
    train_loss: float
    w: float


class SpreadEvaluator:
    """Evaluations of ``peer``'s de-biased model on ``test_set``, each on a snapshot in ``snapshot_model`` (a model
    of the same architecture and precision that nothing else uses), a few batches per round."""

    def __init__(self, peer: Peer, snapshot_model: nn.Module, test_set: Iterable[tuple[Tensor, Tensor]],
                 batches_per_round: int = BATCHES_PER_ROUND) -> None:
        self.peer = peer
        self.snapshot_model = snapshot_model
        self.test_set = test_set
        self.batches_per_round = batches_per_round
        self._running: _Running | None = None

    @property
    def running(self) -> bool:
        return self._running is not None

    def start(self, round_: int) -> Finished | None:
        """Snapshot the model as of ``round_`` and begin its evaluation; one still running is finished first (at
        once) and returned."""
        finished = self.finish()
        self.peer.prepare_evaluation()
        self.snapshot_model.load_state_dict(self.peer.model.state_dict())
        self._running = _Running(Evaluation(self.snapshot_model, self.test_set), round_, self.peer.epoch,
                                 self.peer.last_loss, self.peer.engine.w)
        return finished

    def advance(self) -> Finished | None:
        """Evaluate this round's batches of the running evaluation; its result once it is done."""
        if self._running is None or not self._running.evaluation.advance(self.batches_per_round):
            return None
        return self._done()

    def finish(self) -> Finished | None:
        """Evaluate what is left of the running evaluation at once; its result (None: none was running)."""
        if self._running is None:
            return None
        self._running.evaluation.advance(None)
        return self._done()

    def _done(self) -> Finished:
        running, self._running = self._running, None
        assert running is not None
        loss, acc = running.evaluation.result()
        return Finished(EvalResult(running.round, running.epoch, loss, acc), running.train_loss, running.w)
