"""The Python API builds the same RunSpec the CLI would from keywords, refuses what is not a setting by name, and
trains a model given as a callable on tensors given in code."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from peer.api import _spec_and_source, simulate, train
from peer.config import ConfigError


def tiny_net(num_classes: int, in_channels: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(in_channels, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 8 * 8, num_classes))


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 3
    images = (labels.view(-1, 1, 1, 1) * 80 + torch.randint(0, 40, (n, 1, 8, 8), generator=g)).to(torch.uint8)
    return images, labels


def test_keywords_land_in_their_sections_and_unknown_ones_are_named() -> None:
    spec, source = _spec_and_source(tiny_net, None, {"lr": 0.2, "bits": 6, "comm_bits": 4, "skew": 0.5,
                                                     "root": "/data", "norm": "keep"})
    assert (spec.optim.lr, spec.model.bits, spec.gossip.bits, spec.data.skew) == (0.2, 6, 4, 0.5)
    assert spec.data.root == "/data" and spec.model.norm == "keep"
    assert source is not None and source.kind == "python" and spec.model.name == source.ref
    spec, source = _spec_and_source("mnist-cnn", "synthetic", {})
    assert source is None and spec.model.name == "mnist-cnn" and spec.data.dataset == "synthetic"
    with pytest.raises(ConfigError, match="^learning_rate: not a run setting; known: .*lr"):
        _spec_and_source(tiny_net, None, {"learning_rate": 0.1})
    with pytest.raises(ConfigError, match="gossip.compression"):
        _spec_and_source(tiny_net, None, {"algorithm": "sgp", "compression": 0.5})


def test_train_and_simulate_a_callable_on_tensors() -> None:
    train_set, test_set = _data(192, 0), _data(30, 1)
    rows = train(tiny_net, train_set, test_set, precision="fp32", epochs=4, warmup_epochs=0, lr=0.05, batch_size=16)
    assert [r["epoch"] for r in rows] == [1.0, 2.0, 3.0, 4.0] and rows[-1]["test_acc"] > 0.5  # 3 separable classes
    sim = simulate(tiny_net, train_set, test_set, peers=2, precision="fp32", epochs=1, warmup_epochs=0, lr=0.1,
                   batch_size=16, algorithm="sgp", compression=0.0)
    assert sim[-1]["epoch"] == 1.0 and set(sim[-1]) >= {"avg_model_acc", "mean_peer_acc", "bytes_per_peer"}
    assert sim[-1]["bytes_per_peer"] > 0
