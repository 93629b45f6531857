"""A rogue host on the fleet's LAN (run by tests/test_netns_rogue.py inside its own network namespace).

It uses only grpc, zeroconf and gRPC modules generated from proto/ (``--proto-dir``) - nothing of the project - and
tries what issue 10's attacker did against the fleet's peers, printing one JSON object with the outcome of each:

- fake mDNS records copying a real peer's TXT (same fleet, fingerprint, protocol, algorithm): one under another
  service name claiming the real peer's id, one for a made-up peer served by this host's own (insecure) gRPC
  server, which would accept gossip and serve a crafted model; after ``--hold`` seconds they are withdrawn
  (goodbye), which must not remove the real peer;
- Status, GetModel (also with an empty fingerprint), Identify and a Gossip Hello as a real peer, without a
  certificate and with a self-signed one;
- a connection flood: ``--connections`` TCP connections held open for a while.

Usage: python tests/rogue_host.py --proto-dir DIR --ip MY_IP --victims ID=HOST:PORT,... [--hold 20]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import importlib
import json
import socket
import sys

import grpc
from zeroconf import IPVersion
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

SERVICE_TYPE = "_lpdl._tcp.local."


def self_signed() -> tuple[bytes, bytes]:
    """A self-signed certificate and key (the attacker's best try at a client certificate)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rogue")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


async def attempt(coro) -> str:
    """'OK' or the gRPC status code name (or exception type) the attempt ended with."""
    try:
        await asyncio.wait_for(coro, 10)
        return "OK"
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__


def server_name(fleet: str, peer_id: str) -> str:
    """The TLS name a device certificate carries (the scheme is public: a digest of fleet and peer id)."""
    return "p" + hashlib.sha256(f"{fleet}/{peer_id}".encode()).hexdigest()[:40] + ".lpdl"


async def calls(pb, stub_cls, address: str, claim: str, creds, tls_name: str) -> dict[str, str]:
    """Status, Identify, GetModel and a Gossip Hello claiming ``claim``, over one channel."""
    chan = grpc.aio.insecure_channel(address) if creds is None else grpc.aio.secure_channel(
        address, creds, options=[("grpc.ssl_target_name_override", tls_name)])
    async with chan:
        stub = stub_cls(chan)

        async def get_model(fp: str) -> None:
            async for _ in stub.GetModel(pb.GetModelRequest(fingerprint=fp)):
                pass

        async def gossip() -> None:
            call = stub.Gossip()
            me = pb.PeerIdentity(peer_id=claim, protocol_version=4, fleet="?", fingerprint="?")
            await call.write(pb.GossipFrame(hello=pb.Hello(sender=me, next_seq=2 ** 62 - 1)))
            reply = await call.read()
            if reply is grpc.aio.EOF or reply.WhichOneof("reply") != "hello_reply":
                raise RuntimeError("refused")

        return {"status": await attempt(stub.Status(pb.StatusRequest())),
                "identify": await attempt(stub.Identify(pb.IdentifyRequest())),
                "get_model": await attempt(get_model("")),
                "gossip_as_peer": await attempt(gossip())}


async def flood(host: str, port: int, n: int, hold_s: float) -> int:
    """Open ``n`` TCP connections to host:port, hold them ``hold_s`` seconds; returns how many opened."""
    writers = []
    for _ in range(n):
        try:
            _, w = await asyncio.wait_for(asyncio.open_connection(host, port), 2)
            writers.append(w)
        except (OSError, asyncio.TimeoutError):
            break
    await asyncio.sleep(hold_s)
    for w in writers:
        w.close()
    return len(writers)


async def main(args: argparse.Namespace) -> dict:
    sys.path.insert(0, args.proto_dir)
    pb = importlib.import_module("lpdl.v1.peer_pb2")
    grpc_mod = importlib.import_module("lpdl.v1.peer_pb2_grpc")
    victims = dict(v.split("=", 1) for v in args.victims.split(","))
    out: dict = {}

    # a fake peer of our own: answers Identify as "ghost" and takes any gossip (insecure, it has no certificate)
    class Fake(grpc_mod.PeerServicer):
        async def Identify(self, request, context):  # noqa: N802
            return pb.PeerIdentity(peer_id="ghost", protocol_version=int(txt["proto"]), fingerprint=txt["fp"],
                                   fleet=txt["fleet"], algorithm=txt["alg"])

    zc = AsyncZeroconf(interfaces=[args.ip], ip_version=IPVersion.V4Only)
    real_id, real_addr = next(iter(victims.items()))
    info = AsyncServiceInfo(SERVICE_TYPE, f"{real_id}.{SERVICE_TYPE}")
    assert await info.async_request(zc.zeroconf, 5000), f"could not resolve {real_id}'s record"
    txt = {k.decode(): (v or b"").decode() for k, v in info.properties.items()}
    out["copied_txt"] = txt
    server = grpc.aio.server()
    grpc_mod.add_PeerServicer_to_server(Fake(), server)
    fake_port = server.add_insecure_port(f"{args.ip}:0")
    await server.start()
    records = []
    for name, claimed, port in ((f"rogue.{SERVICE_TYPE}", real_id, fake_port),
                                (f"ghost.{SERVICE_TYPE}", "ghost", fake_port)):
        record = AsyncServiceInfo(SERVICE_TYPE, name, port=port, properties={**txt, "id": claimed},
                                  addresses=[socket.inet_aton(args.ip)], server=f"{name.split('.')[0]}-x.local.")
        await (await zc.async_register_service(record))
        records.append(record)
    out["records"] = [r.name for r in records]

    cert, key = self_signed()
    ca = open(args.ca, "rb").read() if args.ca else cert
    for peer_id, address in victims.items():
        claim = next(p for p in victims if p != peer_id) if len(victims) > 1 else "someone"
        name = server_name(txt["fleet"], peer_id)
        out[f"{peer_id}/no_cert"] = await calls(pb, grpc_mod.PeerStub, address, claim, None, name)
        out[f"{peer_id}/self_signed"] = await calls(pb, grpc_mod.PeerStub, address, claim,
                                                    grpc.ssl_channel_credentials(ca, key, cert), name)
    host, _, port = real_addr.rpartition(":")
    out["flood_connections"] = await flood(host, int(port), args.connections, args.hold / 2)
    await asyncio.sleep(args.hold / 2)
    for record in records:
        await (await zc.async_unregister_service(record))  # goodbye: must not remove the real peer
    await zc.async_close()
    await server.stop(0)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proto-dir", required=True)
    parser.add_argument("--ip", required=True)
    parser.add_argument("--victims", required=True, help="ID=HOST:PORT,... (the first one's record is copied)")
    parser.add_argument("--ca", default="", help="the fleet's public CA certificate (to try TLS against it)")
    parser.add_argument("--hold", type=float, default=20.0, help="seconds the fake records stand")
    parser.add_argument("--connections", type=int, default=300)
    print(json.dumps(asyncio.run(main(parser.parse_args()))), flush=True)
