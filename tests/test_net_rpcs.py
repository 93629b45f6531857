"""GetModel, Identify, Status and the standard health service over a real server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from peer.net.api import model_from_bytes
from peer.net.client import fetch_model, identify
from peer.net.config import NetConfig
from peer.net.proto.lpdl.v1 import peer_pb2 as pb
from peer.net.proto.lpdl.v1 import peer_pb2_grpc
from peer.net.server import SERVICE_NAME, PeerServer
from tests.test_net_support import FINGERPRINT, INSECURE, LAYOUT, make_gate

CONFIG = NetConfig(model_chunk_bytes=100, chunk_bytes=100, max_chunk_bytes=100)


def test_get_model_round_trips_in_chunks() -> None:
    async def main() -> None:
        b = make_gate("peer-b", seed=21)
        b.engine.state.w = 0.5  # de-biasing must divide by w
        server = PeerServer(b, CONFIG, security=INSECURE)
        port = await server.start("127.0.0.1:0")
        try:
            data = await fetch_model(f"127.0.0.1:{port}", FINGERPRINT, "joiner", CONFIG, security=INSECURE)
            z = model_from_bytes(data, LAYOUT.numel)
            assert torch.equal(z, b.engine.x / b.engine.w)
            assert len(data) > 3 * CONFIG.model_chunk_bytes  # really chunked
            assert server.links.get("joiner").bytes_sent > len(data)
            with pytest.raises(grpc.RpcError) as err:
                await fetch_model(f"127.0.0.1:{port}", "other-fp", "joiner", CONFIG, security=INSECURE)
            assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert server.counters.refused["fingerprint"] == 1
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_identify_status_and_health() -> None:
    async def main() -> None:
        b = make_gate("peer-b", seed=22)
        server = PeerServer(b, CONFIG, security=INSECURE)
        port = await server.start("127.0.0.1:0")
        try:
            who = await identify(f"127.0.0.1:{port}", security=INSECURE)
            assert who == b.identity()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                status = json.loads((await peer_pb2_grpc.PeerStub(channel).Status(pb.StatusRequest())).json)
                assert status == b.status()  # the gate's document, as the control socket serves it
                check = health_pb2_grpc.HealthStub(channel).Check
                reply = await check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.stop(0)

    asyncio.run(main())
