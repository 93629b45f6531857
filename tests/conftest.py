"""Shared fixtures."""

import pytest
import torch

from peer.logs import quiet_grpc_core

quiet_grpc_core()  # before any test opens a channel: gRPC's C core INFO lines ("Got goaway") stay out of reports


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module on one torch thread (deterministic kernels, fair to the other core), then restore."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
