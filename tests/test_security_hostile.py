"""Hostile peers against a secured fleet (issue 10), with the attacker's OWN client: gRPC modules generated from
proto/ at test time with grpc_tools.protoc, frames and calls built by hand - none of the project's client, wire or
security code is used to attack (protobuf's descriptor pool shares the message classes of identical .proto files,
nothing else). Real gRPC over 127.0.0.1 sockets with mutual TLS.

Each attack is refused with a code and a counter and changes nothing in the target's engine; meanwhile three honest
peers keep gossiping through the project's EdgeSender, and afterwards the fleet's sum of x and w (plus in-flight
mass) is exactly what it was: no attack created, destroyed or redirected mass.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import ssl
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch
from cryptography import x509

from peer.compress.codec import CodecConfig, encode
from peer.net.accounting import UNKNOWN_PEER
from peer.net.api import PROTOCOL_VERSION
from peer.net.client import EdgeSender
from peer.net.config import NetConfig
from peer.net.server import PeerServer
from peer.security import ca
from peer.security.credentials import TransportSecurity
from tests.hostile_client import generate
from tests.test_net_support import FINGERPRINT, FLEET, INSECURE, LAYOUT, assert_snapshot_equal, engine_snapshot, make_gate, totals

ROOT = Path(__file__).resolve().parents[1]
HONEST = ("peer-a", "peer-b", "peer-c")
#: Small limits so each bound is reached with a few frames (the model's largest payload is ~2.9 KB).
CONFIG = NetConfig(connect_timeout_s=3.0, ack_timeout_s=5.0, backoff_base_s=0.02, backoff_max_s=0.3,
                   close_timeout_s=3.0, chunk_bytes=512, max_chunk_bytes=1024, max_payload_bytes=64 * 1024,
                   max_buffered_bytes=2048, reassembly_timeout_s=1.0, max_peers=8, get_model_burst=2,
                   get_model_rate_per_s=0.001)


# --- the attacker's tools (no peer.net / peer.security code) -------------------------------------------------------
@pytest.fixture(scope="module")
def rpc(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The attacker's gRPC modules, generated from proto/ alone."""
    pytest.importorskip("grpc_tools")
    return generate(tmp_path_factory.mktemp("attacker_proto"))


def server_name(peer_id: str) -> str:
    """The DNS name a device certificate carries (public knowledge: a digest of fleet and peer id)."""
    return "p" + hashlib.sha256(f"{FLEET}/{peer_id}".encode()).hexdigest()[:40] + ".lpdl"


def channel(port: int, key_dir: Path | None, trust: Path | None = None, target: str = "peer-a") -> grpc.aio.Channel:
    """The attacker's channel: no TLS (``key_dir`` None), or TLS presenting the key and certificate in ``key_dir``
    while trusting the CA certificate ``trust`` (the fleet's public ca.pem by default)."""
    if key_dir is None:
        return grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    creds = grpc.ssl_channel_credentials((trust or key_dir / "ca.pem").read_bytes(),
                                         (key_dir / "key.pem").read_bytes(), (key_dir / "cert.pem").read_bytes())
    return grpc.aio.secure_channel(f"127.0.0.1:{port}", creds,
                                   options=[("grpc.ssl_target_name_override", server_name(target))])


def payload(seed: int = 0) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    data, _ = encode(torch.randn(LAYOUT.numel, generator=gen), LAYOUT, CodecConfig(), gen)
    return data


def hello(rpc: SimpleNamespace, sender: str, next_seq: int = 1, receiver: str = "peer-a"):
    pb = rpc.pb
    me = pb.PeerIdentity(peer_id=sender, protocol_version=PROTOCOL_VERSION, fingerprint=FINGERPRINT, fleet=FLEET,
                         algorithm="sgp")
    return pb.GossipFrame(hello=pb.Hello(sender=me, receiver_id=receiver, next_seq=next_seq))


def update(rpc: SimpleNamespace, seq: int, data: bytes, weight: float = 0.1, scale: float = 0.25,
           total: int | None = None, count: int = 1, index: int = 0):
    return rpc.pb.GossipFrame(update=rpc.pb.Update(seq=seq, round=1, weight=weight, scale=scale, algorithm="sgp",
                                                   chunk_index=index, chunk_count=count,
                                                   total_length=len(data) if total is None else total, data=data))


async def gossip(rpc: SimpleNamespace, port: int, key_dir: Path | None, frames: list, hold_s: float = 0.0,
                 trust: Path | None = None) -> list:
    """Send ``frames`` on one Gossip stream (optionally stalling ``hold_s`` before half-closing); every reply."""
    replies = []
    async with channel(port, key_dir, trust) as ch:
        call = rpc.stub(ch).Gossip()
        for frame in frames:
            try:
                await call.write(frame)
            except (asyncio.InvalidStateError, grpc.aio.AioRpcError):  # the server already ended the stream
                break                                                   # (a refusal): read what it said
        await asyncio.sleep(hold_s)
        try:
            await call.done_writing()
        except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
            pass
        async for reply in call:
            replies.append(reply)
    return replies


def refusal(replies: list) -> tuple[str, str]:
    """(code name, reason) of the refusal that ended the stream."""
    last = replies[-1]
    assert last.WhichOneof("reply") == "refusal", replies
    return type(last.refusal).DESCRIPTOR.fields_by_name["code"].enum_type.values_by_number[last.refusal.code].name, \
        last.refusal.reason


# --- the fleet's keys ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pki")
    ca.init_ca(root / "ca", FLEET)
    for name in (*HONEST, "mallory", "mallory2"):  # mallory*: devices of the fleet an attacker took over
        ca.issue(root / "ca", name, root / name)
    ca.issue(root / "ca", "ops", root / "ops", role="operator")
    ca.init_ca(root / "rogue-ca", FLEET)  # same fleet name, another key: certifies a real peer's id
    ca.issue(root / "rogue-ca", "peer-b", root / "rogue-b")
    ca.init_ca(root / "other-ca", "other-fleet")
    ca.issue(root / "other-ca", "peer-b", root / "other-b")
    # peer-a's TLS directory trusting both fleets' CAs (an operator's mistake): the fleet check still refuses
    shutil.copytree(root / "peer-a", root / "peer-a-lax")
    (root / "peer-a-lax" / "ca.pem").write_bytes((root / "ca" / "ca.pem").read_bytes()
                                                 + (root / "other-ca" / "ca.pem").read_bytes())
    return root


async def wait_for(predicate, timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


class Fleet:
    """Three honest peers gossiping over mutual TLS (full mesh of EdgeSenders), plus one extra server of peer-a
    whose TLS directory also trusts another fleet's CA."""

    def __init__(self, pki: Path) -> None:
        self.pki = pki
        self.gates = {p: make_gate(p, "sgp", seed=i + 1) for i, p in enumerate(HONEST)}
        self.security = {p: TransportSecurity.from_dir(pki / p, FLEET) for p in HONEST}
        self.servers = {p: PeerServer(g, CONFIG, security=self.security[p]) for p, g in self.gates.items()}
        self.lax = PeerServer(self.gates["peer-a"], CONFIG,
                              security=TransportSecurity.from_dir(pki / "peer-a-lax", FLEET))
        self.ports: dict[str, int] = {}
        self.edges: dict[tuple[str, str], EdgeSender] = {}
        self.round = 0

    async def start(self) -> None:
        for p, server in self.servers.items():
            self.ports[p] = await server.start("127.0.0.1:0")
        self.ports["lax"] = await self.lax.start("127.0.0.1:0")
        for a in HONEST:
            for b in HONEST:
                if a != b:
                    edge = EdgeSender(self.gates[a], b, f"127.0.0.1:{self.ports[b]}", CONFIG,
                                      self.servers[a].links, security=self.security[a])
                    edge.start()
                    self.edges[a, b] = edge
        await wait_for(lambda: all(e.ready for e in self.edges.values()))

    async def rounds(self, n: int) -> None:
        """``n`` honest gossip rounds, each settled (every message acknowledged)."""
        for _ in range(n):
            for a in HONEST:
                await wait_for(lambda: all(self.edges[a, b].ready for b in HONEST if b != a))
                for msg in self.gates[a].engine.send_round([b for b in HONEST if b != a], self.round):
                    self.edges[a, msg.receiver].submit(msg)
            for edge in self.edges.values():
                assert await edge.wait_idle(10)
            self.round += 1

    async def close(self) -> None:
        for edge in self.edges.values():
            await edge.close()
        for server in (*self.servers.values(), self.lax):
            await server.stop(0)


def test_attacks_on_a_secured_fleet_are_refused_and_mass_stays_exact(rpc: SimpleNamespace, pki: Path) -> None:
    async def main() -> None:
        fleet = Fleet(pki)
        before = totals(list(fleet.gates.values()))
        await fleet.start()
        try:
            await fleet.rounds(2)
            a, server = fleet.gates["peer-a"], fleet.servers["peer-a"]
            port = fleet.ports["peer-a"]
            # two taken-over devices introduce themselves once (a device of the fleet may have edge state)
            for name in ("mallory", "mallory2"):
                assert (await gossip(rpc, port, pki / name, [hello(rpc, name)]))[0].WhichOneof("reply") \
                    == "hello_reply"
            b_stream = server.inbound.get("peer-b")
            P = payload()
            bound = server.max_payload_bytes
            JUNK = b"x" * 1000  # the first chunks of an update that is never finished

            async def refused(name: str, key_dir: Path | None, frames: list, code: str, reason: str, **kw) -> None:
                snap = engine_snapshot(a)
                counted = server.counters.refused[reason] + fleet.lax.counters.refused[reason]
                got = refusal(await gossip(rpc, kw.pop("port", port), key_dir, frames, **kw))
                assert got == (code, reason), f"{name}: {got}"
                assert server.counters.refused[reason] + fleet.lax.counters.refused[reason] == counted + 1, name
                assert_snapshot_equal(snap, engine_snapshot(a))

            async def unreachable(name: str, key_dir: Path | None, trust: Path | None = None) -> None:
                snap = engine_snapshot(a)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await gossip(rpc, port, key_dir, [hello(rpc, "peer-b"), update(rpc, 1, P, weight=1000.0)],
                                 trust=trust)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, name  # the TLS handshake failed
                assert_snapshot_equal(snap, engine_snapshot(a))

            # nobody without a fleet certificate gets a frame through
            await unreachable("no client certificate", None)
            await unreachable("certificate of another CA naming peer-b", pki / "rogue-b", trust=pki / "ca" / "ca.pem")
            await refused("another fleet's certificate", pki / "other-b", [hello(rpc, "peer-b")],
                          "REFUSAL_UNAUTHENTICATED", "wrong_fleet", port=fleet.ports["lax"],
                          trust=pki / "ca" / "ca.pem")
            await refused("operator gossips", pki / "ops", [hello(rpc, "ops")], "REFUSAL_UNAUTHENTICATED",
                          "not_a_peer")
            # a member speaking as another member (peer-b): refused, peer-b's own stream untouched
            await refused("Hello as peer-b", pki / "mallory", [hello(rpc, "peer-b"), update(rpc, 99, P)],
                          "REFUSAL_UNAUTHENTICATED", "sender_mismatch")
            assert server.inbound.get("peer-b") is b_stream and not b_stream.superseded
            # implausible numbers
            await refused("weight 1000", pki / "mallory", [hello(rpc, "mallory"), update(rpc, 1, P, weight=1000.0)],
                          "REFUSAL_BAD_UPDATE", "implausible_weight")
            await refused("weight 1e308", pki / "mallory", [hello(rpc, "mallory"), update(rpc, 1, P, weight=1e308)],
                          "REFUSAL_BAD_UPDATE", "implausible_weight")
            await refused("payload over the model's bound", pki / "mallory",
                          [hello(rpc, "mallory"), update(rpc, 1, b"x" * 600, total=bound + 1, count=2)],
                          "REFUSAL_BAD_CHUNK", "payload_too_large")
            # a stalled partial update: freed at the reassembly deadline
            await refused("stall inside an update", pki / "mallory",
                          [hello(rpc, "mallory"), update(rpc, 1, JUNK, total=bound, count=3)],
                          "REFUSAL_LIMIT", "reassembly_timeout", hold_s=2 * CONFIG.reassembly_timeout_s)
            assert server.buffered.used == 0
            # two partial updates together past max_buffered_bytes
            stall = asyncio.ensure_future(gossip(rpc, port, pki / "mallory2", [
                hello(rpc, "mallory2"), update(rpc, 1, JUNK, total=bound, count=3),
                update(rpc, 1, JUNK, total=bound, count=3, index=1)], hold_s=0.5))
            await wait_for(lambda: server.buffered.used >= 2000)
            await refused("buffers full", pki / "mallory",
                          [hello(rpc, "mallory"), update(rpc, 1, JUNK, total=bound, count=3)],
                          "REFUSAL_LIMIT", "buffer_full")
            await stall
            await wait_for(lambda: server.buffered.used == 0)
            # GetModel: fingerprint and rate (devices and operators may read the model)
            async with channel(port, pki / "mallory") as ch:
                for request, code in ((rpc.pb.GetModelRequest(), grpc.StatusCode.FAILED_PRECONDITION),
                                      (rpc.pb.GetModelRequest(fingerprint="x"), grpc.StatusCode.FAILED_PRECONDITION)):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        [c async for c in rpc.stub(ch).GetModel(request)]
                    assert err.value.code() == code
                codes = []
                for _ in range(CONFIG.get_model_burst + 1):
                    try:
                        [c async for c in rpc.stub(ch).GetModel(rpc.pb.GetModelRequest(fingerprint=FINGERPRINT))]
                        codes.append(grpc.StatusCode.OK)
                    except grpc.aio.AioRpcError as exc:
                        codes.append(exc.code())
                assert codes == [grpc.StatusCode.OK] * CONFIG.get_model_burst + [grpc.StatusCode.RESOURCE_EXHAUSTED]
            async with channel(port, pki / "ops") as ch:
                # an operator may read the model (lpdl-peer export --peer); the rate limit is per caller, so the
                # budget the member above drained is not the operator's (issue 23: an insider starved joiners)
                chunks = [c async for c in rpc.stub(ch).GetModel(rpc.pb.GetModelRequest(fingerprint=FINGERPRINT))]
                assert chunks and chunks[0].total_length > 0
                assert "peer_id" in (await rpc.stub(ch).Status(rpc.pb.StatusRequest())).json  # operators may read
            with pytest.raises(grpc.aio.AioRpcError):
                async with channel(port, None) as ch:
                    await rpc.stub(ch).Status(rpc.pb.StatusRequest(), timeout=5)
            assert {"no_fingerprint", "fingerprint", "get_model_rate", "not_a_peer"} <= set(server.counters.refused)
            # revocation, no restart: the list lands in peer-a's TLS directory
            (pki / "peer-a" / "revoked").write_text("peer:mallory\n")
            await refused("revoked device", pki / "mallory", [hello(rpc, "mallory")], "REFUSAL_UNAUTHENTICATED",
                          "revoked")
            # the honest fleet kept working through all of it
            await fleet.rounds(2)
            # peer-b's own key opening a second stream supersedes its first, and only that: REFUSAL_SUPERSEDED
            old = server.inbound.get("peer-b")
            replies = await gossip(rpc, port, pki / "peer-b", [hello(rpc, "peer-b", next_seq=10**6)], hold_s=0.3)
            assert replies[0].WhichOneof("reply") == "hello_reply"
            assert old.superseded and server.counters.refused["superseded"] >= 1
            await fleet.rounds(2)
            assert set(server.links.snapshot()) <= {*HONEST, "mallory", "mallory2", "ops", UNKNOWN_PEER}
        finally:
            await fleet.close()
        after = totals(list(fleet.gates.values()))
        assert torch.allclose(after.mass, before.mass, atol=1e-4, rtol=1e-6), (after.mass - before.mass).abs().max()
        assert after.weight == pytest.approx(before.weight, abs=1e-9)
        for gate in fleet.gates.values():
            assert all(sender in HONEST for sender, _ in gate.applied)  # no attacker's update was ever applied
            assert len(gate.applied) == len(set(gate.applied))

    asyncio.run(main())


def test_per_peer_state_is_capped_under_a_flood_of_ids(rpc: SimpleNamespace) -> None:
    """Lab mode (no TLS), where ids are only claimed: 200 made-up ids get edge state for at most net.max_peers of
    them, the rest REFUSAL_LIMIT; links and status keep no entry for refused ids."""
    config = NetConfig(max_peers=4, connect_timeout_s=3.0)

    async def main() -> None:
        gate = make_gate("peer-a", "sgp", max_peers=config.max_peers)  # as the daemon builds it from net.max_peers
        server = PeerServer(gate, config, security=INSECURE)
        port = await server.start("127.0.0.1:0")
        try:
            results = []
            for batch in range(0, 200, 16):  # gRPC multiplexes these calls on one connection: stay under its
                results += await asyncio.gather(*(gossip(rpc, port, None, [hello(rpc, f"ghost-{i}")])  # stream cap
                                                  for i in range(batch, min(batch + 16, 200))))
        finally:
            await server.stop(0)
        kinds = [r[0].WhichOneof("reply") for r in results]
        assert kinds.count("hello_reply") <= config.max_peers
        assert server.counters.refused["peer_limit"] == kinds.count("refusal") == 200 - kinds.count("hello_reply")
        assert len(gate.engine.known_peers()) <= config.max_peers
        assert len(server.links.snapshot()) <= config.max_peers + 1  # accepted ids plus "?"

    asyncio.run(main())


def test_sender_survives_a_hostile_hello_reply(rpc: SimpleNamespace) -> None:
    """A receiver answering with fence = last_applied = 2^64 - 1 (which used to wedge the edge forever): the
    sender settles nothing, keeps its numbers and its in-flight message, and keeps retrying."""
    pb, attacker_grpc = rpc.pb, rpc.grpc

    async def main() -> None:
        class Liar(attacker_grpc.PeerServicer):
            async def Gossip(self, requests, context):  # noqa: N802
                async for _ in requests:
                    me = pb.PeerIdentity(peer_id="peer-b", protocol_version=PROTOCOL_VERSION,
                                         fingerprint=FINGERPRINT, fleet=FLEET, algorithm="sgp")
                    yield pb.GossipReply(hello_reply=pb.HelloReply(last_applied=2**64 - 1, fence=2**64 - 1,
                                                                   receiver=me))

        server = grpc.aio.server()
        attacker_grpc.add_PeerServicer_to_server(Liar(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        a = make_gate("peer-a", "sgp")
        [msg] = a.engine.send_round(["peer-b"], 0)
        edge_before = (a.engine.out_edges["peer-b"].next_seq, dict(a.engine.out_edges["peer-b"].in_flight))
        sender = EdgeSender(a, "peer-b", f"127.0.0.1:{port}", CONFIG, security=INSECURE)
        sender.start()
        sender.submit(msg)
        try:
            await wait_for(lambda: sender.stream.handshakes == 0 and "hostile HelloReply" in sender.last_error)
            await asyncio.sleep(0.3)  # several more attempts
        finally:
            sender._closing = True
            sender._task.cancel()
            await asyncio.gather(sender._task, return_exceptions=True)
            await server.stop(0)
        assert (a.engine.out_edges["peer-b"].next_seq, dict(a.engine.out_edges["peer-b"].in_flight)) == edge_before
        assert a.engine.hello_for("peer-b").next_seq < 2**62

    asyncio.run(main())


async def served_serial(port: int, client_dir: Path) -> int:
    """Serial of the certificate the server at ``port`` presents in a TLS handshake (Python's ssl module)."""
    context = ssl.create_default_context(cafile=str(client_dir / "ca.pem"))
    context.load_cert_chain(client_dir / "cert.pem", client_dir / "key.pem")
    context.set_alpn_protocols(["h2"])
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context, server_hostname=server_name("peer-a"))
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    finally:
        writer.close()
    return x509.load_der_x509_certificate(der).serial_number


def test_rotated_certificates_are_used_without_restart(pki: Path, tmp_path: Path) -> None:
    """Re-issuing a running server's and a client's certificates (`lpdl-peer ca issue` into the same directory):
    the next connections present the new ones; nothing restarts."""
    for name in ("peer-a", "peer-b"):
        shutil.copytree(pki / name, tmp_path / name)

    async def main() -> None:
        a, b = make_gate("peer-a", "sgp"), make_gate("peer-b", "sgp")
        sec_a = TransportSecurity.from_dir(tmp_path / "peer-a", FLEET)
        sec_b = TransportSecurity.from_dir(tmp_path / "peer-b", FLEET)
        callers: list[int] = []
        served: list[int] = []
        server = PeerServer(a, CONFIG, security=sec_a)
        original = sec_a.caller

        def recording_caller(context):  # what the server's auth context said about the client
            identity = original(context)
            callers.append(identity.serial)
            return identity

        sec_a.caller = recording_caller  # type: ignore[method-assign]
        port = await server.start("127.0.0.1:0")
        old = {"a": sec_a.identity.serial, "b": sec_b.identity.serial}
        try:
            for _ in range(2):
                served.append(await served_serial(port, tmp_path / "peer-b"))
                edge = EdgeSender(b, "peer-a", f"127.0.0.1:{port}", CONFIG, security=sec_b)
                edge.start()
                await wait_for(lambda: edge.ready)
                for msg in b.engine.send_round(["peer-a"], 0):
                    edge.submit(msg)
                assert await edge.wait_idle(10)
                await edge.close()
                ca.issue(pki / "ca", "peer-a", tmp_path / "peer-a")
                ca.issue(pki / "ca", "peer-b", tmp_path / "peer-b")
        finally:
            await server.stop(0)
        assert callers[0] == old["b"] and callers[-1] != old["b"]  # the server saw the client's new certificate
        assert served[0] == old["a"] and served[1] != old["a"]  # and presented its own new one

    asyncio.run(main())
