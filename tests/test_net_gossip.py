"""Two real engines gossiping through the real gRPC server and EdgeSender on 127.0.0.1, with lr = 0:
mass conservation, at-most-once application and replica agreement, including under injected stream breaks."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
import torch

from peer.net.client import EdgeSender, EdgeState
from peer.net.config import NetConfig
from peer.net.server import PeerServer
from tests.test_net_support import INSECURE, make_gate, totals

FAST = NetConfig(connect_timeout_s=2.0, ack_timeout_s=2.0, backoff_base_s=0.02, backoff_max_s=0.2,
                 close_timeout_s=2.0, chunk_bytes=64)


async def wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


def assert_conserved(gates, before) -> None:
    after = totals(gates)
    assert torch.allclose(after.mass, before.mass, atol=1e-4, rtol=1e-6), (after.mass - before.mass).abs().max()
    assert after.weight == pytest.approx(before.weight, abs=1e-9)


def assert_replicas_agree(a, b) -> None:
    if a.engine.algorithm.name == "choco":
        assert torch.equal(a.engine.algorithm.replica_out(b.engine.peer_id), b.engine.algorithm.replica_in(a.engine.peer_id))
        assert torch.equal(b.engine.algorithm.replica_out(a.engine.peer_id), a.engine.algorithm.replica_in(b.engine.peer_id))


def assert_at_most_once(*gates) -> None:
    for gate in gates:
        assert len(gate.applied) == len(set(gate.applied)), "a message was applied twice"


@pytest.mark.parametrize("algorithm", ["choco", "sgp"])
def test_two_peers_exchange_and_converge(algorithm: str) -> None:
    async def main() -> None:
        a, b = make_gate("peer-a", algorithm, seed=1), make_gate("peer-b", algorithm, seed=2)
        before = totals([a, b])
        initial_gap = (a.engine.x - b.engine.x).abs().mean().item()
        servers = {g.engine.peer_id: PeerServer(g, FAST, security=INSECURE) for g in (a, b)}
        ports = {pid: await s.start("127.0.0.1:0") for pid, s in servers.items()}
        ab = EdgeSender(a, "peer-b", f"127.0.0.1:{ports['peer-b']}", FAST, servers["peer-a"].links, security=INSECURE)
        ba = EdgeSender(b, "peer-a", f"127.0.0.1:{ports['peer-a']}", FAST, servers["peer-b"].links, security=INSECURE)
        for s in (ab, ba):
            s.start()
        await wait_for(lambda: ab.ready and ba.ready)
        for rnd in range(40):
            for gate, sender, other in ((a, ab, "peer-b"), (b, ba, "peer-a")):
                for msg in gate.engine.send_round([other], rnd):
                    sender.submit(msg)
            assert await ab.wait_idle(5) and await ba.wait_idle(5)
        assert ab.delivered == 40 and ba.delivered == 40
        assert_conserved([a, b], before)
        assert_replicas_agree(a, b)
        assert_at_most_once(a, b)
        za, zb = a.engine.x / a.engine.w, b.engine.x / b.engine.w
        assert (za - zb).abs().mean().item() < 0.5 * initial_gap  # gossip through the wire makes them agree
        link = servers["peer-a"].links.get("peer-b")
        assert link.bytes_sent > 0 and link.bytes_received > 0
        assert ab.snapshot().hello_rtt_s is not None and ab.snapshot().ack_rtt_s is not None
        for s in (ab, ba):
            await s.close()
        for s in servers.values():
            await s.stop(0)

    asyncio.run(main())


@pytest.mark.parametrize(("algorithm", "window", "chunk_bytes"),
                         [("choco", 1, 64), ("sgp", 1, 64), ("choco", 3, 64), ("sgp", 3, 64),
                          ("choco", 3, 1 << 20), ("sgp", 3, 1 << 20)])
def test_exactly_once_under_stream_breaks(algorithm: str, window: int, chunk_bytes: int) -> None:
    """Server killed mid-stream and restarted on the same port, client calls cancelled mid-message, client
    restarted without settling, with one or several updates in flight, each update cut in chunks (64-byte chunks)
    or several whole updates in one UpdateBatch frame (1 MiB chunks): mass is conserved, nothing applied twice,
    replicas agree after settling."""
    config = dataclasses.replace(FAST, chunk_bytes=chunk_bytes)

    async def main() -> None:
        a = make_gate("peer-a", algorithm, seed=3, window=window)
        b = make_gate("peer-b", algorithm, seed=4, window=window)
        before = totals([a, b])
        rng = random.Random(7)
        server_b = PeerServer(b, config, security=INSECURE)
        port = await server_b.start("127.0.0.1:0")
        address = f"127.0.0.1:{port}"
        sender = EdgeSender(a, "peer-b", address, config, rng=random.Random(1), security=INSECURE)
        senders = [sender]
        sender.start()
        faults = {"server_restart": 0, "cancel_call": 0, "client_restart": 0}
        for rnd in range(60):
            await wait_for(lambda: not a.in_flight_count("peer-b") and sender.state is not EdgeState.CONNECTING,
                           15.0)
            for sub in range(window):
                for msg in a.engine.send_round(["peer-b"], rnd * window + sub):
                    sender.submit(msg)
            fault = rnd % 4
            await asyncio.sleep(rng.uniform(0.0, 0.004))  # land somewhere inside the chunked message
            if fault == 1:
                await server_b.stop(0)
                server_b = PeerServer(b, config, security=INSECURE)
                assert await server_b.start(address) == port
                faults["server_restart"] += 1
            elif fault == 2:
                await wait_for(lambda: sender._call is not None, 5.0)
                sender._call.cancel()
                faults["cancel_call"] += 1
            elif fault == 3:
                sender._task.cancel()  # crash-like: no settling handshake
                await asyncio.gather(sender._task, return_exceptions=True)
                sender = EdgeSender(a, "peer-b", address, config, rng=random.Random(rnd), security=INSECURE)
                senders.append(sender)
                sender.start()
                faults["client_restart"] += 1
        await sender.close()  # settles whatever is in flight
        assert not a.in_flight_count("peer-b")
        assert_conserved([a, b], before)
        assert_at_most_once(b)
        # one more clean exchange after all the faults: the edge is healthy again, replicas agree
        sender = EdgeSender(a, "peer-b", address, config, security=INSECURE)
        sender.start()
        await wait_for(lambda: sender.ready)
        for msg in a.engine.send_round(["peer-b"], 999):
            sender.submit(msg)
        assert await sender.wait_idle(5)
        await sender.close()
        assert_conserved([a, b], before)
        assert_replicas_agree(a, b)
        assert_at_most_once(b)
        assert len(b.applied) >= 10, b.applied  # the faults did not stop gossip
        assert min(faults.values()) > 0
        batched = sum(s.batched for s in senders)
        assert batched > 0 if chunk_bytes > 64 and window > 1 else batched == 0
        await server_b.stop(0)

    asyncio.run(main())


def test_newer_stream_supersedes_older() -> None:
    async def main() -> None:
        a, b = make_gate("peer-a", seed=5), make_gate("peer-b", seed=6)
        server = PeerServer(b, FAST, security=INSECURE)
        port = await server.start("127.0.0.1:0")
        first = EdgeSender(a, "peer-b", f"127.0.0.1:{port}", FAST, security=INSECURE)
        first.start()
        await wait_for(lambda: first.ready)
        first_stream = server.inbound.get("peer-a")
        second = EdgeSender(a, "peer-b", f"127.0.0.1:{port}", FAST, security=INSECURE)
        second.start()
        await wait_for(lambda: second.ready and server.inbound.get("peer-a") is not first_stream)
        # the older stream is told why (REFUSAL_SUPERSEDED), then ends
        await wait_for(lambda: "REFUSAL_SUPERSEDED" in first.last_error)
        assert server.counters.refused["superseded"] == 1
        await first.close()
        await second.close()
        await server.stop(0)

    asyncio.run(main())


def test_close_to_a_stopped_peer_keeps_mass_in_flight_without_waiting_out_the_deadline() -> None:
    """A clean shutdown whose neighbour already stopped: the connection is refused, so close() gives up at once
    (not after close_timeout_s per stage) and the unsettled update stays in flight for the next handshake."""
    patient = NetConfig(connect_timeout_s=2.0, ack_timeout_s=2.0, backoff_base_s=0.02, backoff_max_s=0.2,
                        close_timeout_s=60.0, chunk_bytes=64)

    async def main() -> None:
        a, b = make_gate("peer-a", "sgp", seed=1), make_gate("peer-b", "sgp", seed=2)
        before = totals([a, b])
        server = PeerServer(b, patient, security=INSECURE)
        port = await server.start("127.0.0.1:0")
        ab = EdgeSender(a, "peer-b", f"127.0.0.1:{port}", patient, server.links, security=INSECURE)
        ab.start()
        await wait_for(lambda: ab.ready)
        await server.stop(0)
        await wait_for(lambda: ab.state is not EdgeState.ACTIVE)
        for msg in a.engine.send_round(["peer-b"], 0):
            ab.submit(msg)
        assert a.in_flight_count("peer-b") == 1
        settlement = await asyncio.wait_for(ab.close(), 20.0)  # a third of one stage's deadline
        assert not settlement.delivered and not settlement.retracted
        assert a.in_flight_count("peer-b") == 1  # neither forgotten nor double-counted
        assert_conserved([a, b], before)

    asyncio.run(main())


def test_a_peer_that_moves_address_is_redialled_by_the_same_edge() -> None:
    """mDNS reports a new address for a peer whose edge is down: the edge table keeps ONE sender for that edge and
    points it at the new address (two senders would run two handshakes on one ledger edge; a late reply to the old
    one could retract a message the new stream delivered)."""
    from peer.net.transport import GrpcTransport
    from tests.daemon_helpers import free_ports

    async def main() -> None:
        a, b = make_gate("peer-a", "sgp", seed=1), make_gate("peer-b", "sgp", seed=2)
        before = totals([a, b])
        server = PeerServer(b, FAST, security=INSECURE)
        port = await server.start("127.0.0.1:0")
        transport = GrpcTransport(a, FAST, server.links, asyncio.get_running_loop(), security=INSECURE)
        transport.sync({"peer-b": f"127.0.0.1:{free_ports(1)[0]}"})  # nothing listens there
        edge = transport.edges["peer-b"]
        await wait_for(lambda: edge.state is EdgeState.DOWN)
        transport.sync({"peer-b": f"127.0.0.1:{port}"})
        assert transport.edges["peer-b"] is edge and edge.address == f"127.0.0.1:{port}"
        await wait_for(lambda: edge.ready)
        for msg in a.engine.send_round(["peer-b"], 0):
            edge.submit(msg)
        assert await edge.wait_idle(5) and edge.delivered == 1
        assert_conserved([a, b], before)
        await transport.settle(5)
        await server.stop(0)

    asyncio.run(main())
