"""The revocation watch (peer/security/revocation.py) without sockets: a revoked holder's open call is cut, cut
again at every sweep until it ends (a cut is a task cancellation, which Python 3.11 can drop), and logged and
counted once; an ended call is left alone. tests/test_security_hostile.py cuts a real stream over TLS."""

from __future__ import annotations

import asyncio

from peer.security.identity import CertIdentity
from peer.security.revocation import RevocationWatch

INSIDER = CertIdentity(fleet="f", role="peer", name="peer-003", serial=0x3)
HONEST = CertIdentity(fleet="f", role="peer", name="peer-001", serial=0x1)


class _Revoked:
    """A revocation list naming the serials given."""

    def __init__(self, *serials: int) -> None:
        self.serials = set(serials)

    def revoked(self, identity: CertIdentity) -> bool:
        return identity.serial in self.serials


def test_a_cut_call_is_cut_again_until_it_ends_and_counted_once() -> None:
    revocations = _Revoked()
    cut_of: dict[str, int] = {"insider": 0, "honest": 0}
    counted: list[CertIdentity] = []
    watch = RevocationWatch(revocations, interval_s=1.0, on_cut=counted.append)  # type: ignore[arg-type]
    untrack = watch.track(INSIDER, "gossip stream", lambda: cut_of.__setitem__("insider", cut_of["insider"] + 1))
    watch.track(HONEST, "gossip stream", lambda: cut_of.__setitem__("honest", cut_of["honest"] + 1))
    assert watch.sweep() == 0 and cut_of == {"insider": 0, "honest": 0}

    revocations.serials.add(INSIDER.serial)
    assert watch.sweep() == 1  # newly cut
    assert watch.sweep() == 0  # cut again (its first cancellation may have been lost), not counted again
    assert cut_of == {"insider": 2, "honest": 0}
    assert watch.cut_calls == 1 and counted == [INSIDER]
    assert len(watch) == 2  # still open: watched until it ends

    untrack()  # the call ended
    assert watch.sweep() == 0 and cut_of["insider"] == 2 and len(watch) == 1


def test_a_task_that_swallows_its_first_cut_is_ended_by_the_next_sweep() -> None:
    """A served call whose task catches the first cancellation (as a dropped one looks to the watch) still ends."""

    async def scenario() -> tuple[bool, int]:
        revocations = _Revoked()
        watch = RevocationWatch(revocations, interval_s=1.0)  # type: ignore[arg-type]
        swallowed = asyncio.Event()

        async def serve() -> None:
            untrack = watch.track_task(INSIDER, "gossip stream")
            try:
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    swallowed.set()  # the first cut is lost
                await asyncio.sleep(3600)
            finally:
                untrack()

        task = asyncio.get_running_loop().create_task(serve())
        await asyncio.sleep(0)
        revocations.serials.add(INSIDER.serial)
        watch.sweep()
        await asyncio.wait_for(swallowed.wait(), 5.0)
        assert not task.done()
        watch.sweep()
        await asyncio.wait({task}, timeout=5.0)
        return task.cancelled(), len(watch)

    cancelled, still_watched = asyncio.run(scenario())
    assert cancelled and still_watched == 0
