"""Shared fixtures."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module on one torch thread (deterministic kernels, fair to the other core), then restore."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
