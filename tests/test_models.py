"""Model registry, every model in every precision mode, fingerprint."""

import subprocess
import sys

import pytest
import torch

from peer.lowp import PrecisionConfig, QConv2d, QLinear
from peer.models import available_models, build_model, model_fingerprint

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def eager_passes(monkeypatch):
    """Eager quantization passes (no per-shape compilation in unit tests; compiled == eager: test_lowp_passes)."""
    monkeypatch.setenv("LPDL_LOWP_EAGER", "1")  # every config's passes decide eager at first use


INPUTS = {"resnet20": (3, 16), "resnet54": (3, 8), "vgg11": (3, 32), "resnet18": (3, 8),
          "mnist-cnn": (1, 28)}


def test_registry_names_and_errors():
    assert available_models() == ["resnet20", "resnet54", "vgg11", "resnet18", "mnist-cnn"]
    with pytest.raises(ValueError, match="resnet20"):
        build_model("resnet21")
    with pytest.raises(ValueError, match="norm"):
        build_model("resnet20", norm="groupnorm")
    with pytest.raises(ValueError, match="num_classes"):
        build_model("resnet20", num_classes=0)


@pytest.mark.parametrize("mode", ["fp32", "sim8", "int8"])
@pytest.mark.parametrize("name", list(INPUTS))
def test_forward_backward_every_mode(name, mode):
    channels, size = INPUTS[name]
    torch.manual_seed(0)
    model = build_model(name, num_classes=7, in_channels=channels, precision=PrecisionConfig(mode))
    out = model(torch.randn(2, channels, size, size))
    assert out.shape == (2, 7)
    out.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    model.eval()
    x = torch.randn(2, channels, size, size)
    assert torch.equal(model(x), model(x))  # eval is deterministic


@pytest.mark.parametrize("name", list(INPUTS))
def test_every_conv_and_linear_is_quantized(name):
    model = build_model(name, in_channels=INPUTS[name][0], precision=PrecisionConfig("sim8"))
    layers = [m for m in model.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    assert layers and all(isinstance(m, (QConv2d, QLinear)) for m in layers)


def test_resnet_depths_and_zero_init_second_norm():
    r20 = build_model("resnet20", norm="evonorm")
    assert len(r20.blocks) == 9 and len(build_model("resnet54").blocks) == 24
    assert all(torch.equal(b.norm2.gamma, torch.zeros_like(b.norm2.gamma)) for b in r20.blocks)
    x = torch.randn(1, 16, 8, 8)
    assert torch.equal(r20.blocks[0](x), x)  # identity block at init (fp32)


def test_resnet18_works_on_64x64():
    torch.manual_seed(0)
    assert build_model("resnet18", num_classes=10)(torch.randn(1, 3, 64, 64)).shape == (1, 10)


def test_fingerprint_stable_and_discriminating():
    base = model_fingerprint("resnet20")
    assert base == model_fingerprint("resnet20", num_classes=10, norm="range-evonorm")
    assert len(base) == 16 and int(base, 16) >= 0
    assert base == model_fingerprint("resnet20", precision=PrecisionConfig("int8"))
    others = {model_fingerprint(n) for n in available_models()}
    others |= {model_fingerprint("resnet20", norm=k) for k in ("evonorm", "batchnorm")}
    others |= {model_fingerprint("resnet20", num_classes=100), model_fingerprint("resnet20", groups=4),
               model_fingerprint("resnet20", in_channels=1)}
    assert len(others) == len(available_models()) + 2 + 3


def test_fingerprint_identical_in_another_process():
    code = "from peer.models import model_fingerprint as f; print(f('mnist-cnn', in_channels=1))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == model_fingerprint("mnist-cnn", in_channels=1)
