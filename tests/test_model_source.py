"""Where a model comes from: --model forms parsed without torch, plug-in builders called with what they accept,
weights files loaded by name, and one-line errors for every way a reference can be wrong."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from peer.config import ConfigError, ModelSpec
from peer.models.kinds import ModelRef, parse_model_ref, parse_options
from peer.models.source import ModelSource, ModelSourceError, load_weights


@pytest.mark.parametrize("text, ref", [
    ("mnist-cnn", ModelRef("registry", "mnist-cnn")),
    ("torchvision:mobilenet_v3_small", ModelRef("torchvision", "mobilenet_v3_small")),
    ("my_pkg.nets:make_net", ModelRef("module", "my_pkg.nets", "make_net")),
    ("models/net.py:Net", ModelRef("file", "models/net.py", "Net")),
    ("net.py:Net", ModelRef("file", "net.py", "Net")),
])
def test_model_references_parse_and_print_back(text: str, ref: ModelRef) -> None:
    assert parse_model_ref(text) == ref and str(ref) == text


@pytest.mark.parametrize("text", ["resnet99", "torchvision:", "a b:c", "mod:not-an-identifier", ":f"])
def test_malformed_model_references_are_config_errors_naming_the_field(text: str) -> None:
    with pytest.raises(ConfigError, match="^model.name: "):
        ModelSpec(name=text)


def test_options_parse_as_literals_and_registry_models_refuse_them() -> None:
    assert parse_options(("width_mult=0.5", "name=abc", "flag=True")) == {"width_mult": 0.5, "name": "abc",
                                                                          "flag": True}
    with pytest.raises(ConfigError, match="model.options"):
        ModelSpec(name="mnist-cnn", options=("width_mult=0.5",))
    with pytest.raises(ConfigError, match="model.norm"):
        ModelSpec(name="mnist-cnn", norm="keep")  # keeping BatchNorm is for the user's own models
    assert ModelSpec(name="torchvision:resnet18", norm="keep").norm == "keep"


def _user_file(tmp_path: Path) -> Path:
    path = tmp_path / "outside" / "user_net.py"
    path.parent.mkdir()
    path.write_text(textwrap.dedent("""
        from torch import nn

        class Net(nn.Module):
            def __init__(self, num_classes, width=8):
                super().__init__()
                self.conv = nn.Conv2d(3, width, 3)
                self.head = nn.Linear(width, num_classes)
            def forward(self, x):
                return self.head(self.conv(x).mean((2, 3)))

        def takes_all(**kw):
            net = Net(kw["num_classes"])
            net.seen = kw
            return net

        def not_a_module(num_classes):
            return 3
    """))
    return path


def test_file_callables_get_num_classes_and_in_channels_only_where_accepted(tmp_path: Path) -> None:
    path = _user_file(tmp_path)
    net = ModelSource.parse(f"{path}:Net", ("width=4",)).build_plain(num_classes=7, in_channels=3)
    assert net.head.out_features == 7 and net.conv.out_channels == 4
    seen = ModelSource.parse(f"{path}:takes_all").build_plain(num_classes=5, in_channels=1).seen
    assert seen == {"num_classes": 5, "in_channels": 1}


def test_torchvision_builder_gets_num_classes_and_options() -> None:
    net = ModelSource.parse("torchvision:mobilenet_v3_small", ("width_mult=0.5",)).build_plain(3, 3)
    assert net.classifier[-1].out_features == 3
    assert net.features[0][0].out_channels == 8  # 16 channels scaled by width_mult


@pytest.mark.parametrize("ref, options, message", [
    ("{path}:Net", ("depth=3",), "does not accept option(s) depth"),
    ("{path}:not_a_module", (), "expected an nn.Module, got int"),
    ("{path}:missing", (), "has no callable 'missing'"),
    ("/nowhere/net.py:Net", (), "file /nowhere/net.py not found"),
    ("torchvision:not_a_net", (), "not a torchvision classification model"),
    ("no_such_module_xyz:Net", (), "cannot import module 'no_such_module_xyz'"),
])
def test_unusable_model_references_fail_in_one_line(tmp_path: Path, ref: str, options: tuple[str, ...],
                                                    message: str) -> None:
    source = ModelSource.parse(ref.format(path=_user_file(tmp_path)), options)
    with pytest.raises(ModelSourceError) as err:
        source.build_plain(num_classes=10, in_channels=3)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_weights_load_by_name_skipping_a_head_of_another_shape(tmp_path: Path) -> None:
    pretrained = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 1000))
    torch.save({"state_dict": pretrained.state_dict()}, tmp_path / "w.pt")
    fresh = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 10))
    skipped = load_weights(fresh, str(tmp_path / "w.pt"), "test")
    assert skipped == ["2.bias", "2.weight"]
    torch.testing.assert_close(fresh[0].weight, pretrained[0].weight)
    torch.save({"other.weight": torch.zeros(3)}, tmp_path / "unrelated.pt")
    with pytest.raises(ModelSourceError, match="shares no tensor"):
        load_weights(fresh, str(tmp_path / "unrelated.pt"), "test")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ModelSourceError, match="not a readable state dict"):
        load_weights(fresh, str(tmp_path / "junk.pt"), "test")


def test_safetensors_weights_and_python_callables(tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch", reason="the export extra provides safetensors")
    net = nn.Linear(3, 2)
    safetensors.save_file(net.state_dict(), str(tmp_path / "w.safetensors"))
    source = ModelSource.from_callable(lambda num_classes: nn.Linear(3, num_classes),
                                       weights=str(tmp_path / "w.safetensors"))
    assert source.kind == "python" and source.ref.startswith("python:")
    torch.testing.assert_close(source.build_plain(2, 3).weight, net.weight)
