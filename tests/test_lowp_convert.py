"""convert(): any model rewritten for a precision, parameters kept, leftovers listed, MACs counted, int8 training saving
1-byte tensors in every converted layer; the mask activations and activation-free norms it uses."""

import copy
import importlib.util
from collections import defaultdict
from itertools import chain

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from peer.lowp import (
    EvoNormS0Linear,
    MaskHardsigmoid,
    MaskHardswish,
    MaskReLU,
    MaskReLU6,
    PrecisionConfig,
    QConv2d,
    QLinear,
    RangeEvoNorm,
    RangeEvoNormLinear,
    resolve_precision,
)
from peer.lowp.convert import convert
from peer.lowp.evonorm import (
    evonorm_s0_linear,
    evonorm_s0_linear_backward,
    range_evonorm_linear,
    range_evonorm_linear_backward,
)
from peer.lowp.masks import HARDSWISH_BINS
from peer.lowp.passes import FusedPasses
from peer.models import build_model
from tests.lowp_helpers import forward_backward, product_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FP32, SIM8 = PrecisionConfig("fp32"), PrecisionConfig("sim8")

#: A user's own model, in a file outside the package: a conv-bn-relu Sequential (folded into one norm), a depthwise
#: conv whose norm's activation is called from forward (BN -> linear norm, Hardswish -> mask), a grouped 'same' conv,
#: a reflect-padded conv (kept), GELU and LayerNorm (kept), pooling, dropout, ReLU6.
USER_MODEL = '''
from torch import nn


class UserNet(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True))
        self.dw = nn.Conv2d(16, 16, 3, stride=2, padding=1, groups=16, bias=False)
        self.dw_bn = nn.BatchNorm2d(16)
        self.act = nn.Hardswish()
        self.grouped = nn.Conv2d(16, 32, 3, padding="same", groups=4)
        self.smooth = nn.Conv2d(32, 32, 3, padding=1, padding_mode="reflect", groups=32)
        self.gelu = nn.GELU()
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.1), nn.Linear(32 * 4 * 4, 64), nn.ReLU6(),
                                  nn.LayerNorm(64), nn.Linear(64, num_classes))

    def forward(self, x):
        x = self.stem(x)
        x = self.act(self.dw_bn(self.dw(x)))
        x = self.pool(self.gelu(self.smooth(self.grouped(x))))
        return self.head(x)
'''
USER_LEFTOVERS = {"smooth": "Conv2d", "gelu": "GELU", "head.4": "LayerNorm"}
#: UserNet's multiply-adds for one 3x16x16 input, by hand: output elements x (C_in / groups) x taps.
USER_MACS = {
    "stem.0": 16 * 16 * 16 * 3 * 9,
    "dw": 16 * 8 * 8 * 1 * 9,
    "grouped": 32 * 8 * 8 * 4 * 9,
    "smooth": 32 * 8 * 8 * 1 * 9,
    "head.2": 64 * 512,
    "head.5": 10 * 64,
}
#: torchvision models at 32x32 (num_classes 10) and their fp32 leftovers: name -> type.
RESNET18_LEFTOVERS = {"avgpool": "AdaptiveAvgPool2d"}
SE_BLOCKS = ["features.1.block.1", *(f"features.{i}.block.2" for i in range(4, 12))]
MOBILENET_LEFTOVERS = {"avgpool": "AdaptiveAvgPool2d", **{f"{se}.avgpool": "AdaptiveAvgPool2d" for se in SE_BLOCKS}}


@pytest.fixture(autouse=True)
def eager_passes(monkeypatch):
    """Eager quantization passes: stochastic rounding draws what sim8's does (as test_lowp_layers.py)."""
    monkeypatch.setenv("LPDL_LOWP_EAGER", "1")  # every config's passes decide eager at first use


@pytest.fixture(scope="module")
def int8():
    """int8 as resolve_precision gives it on this CPU (the kernels its probe proves exact here), eager passes."""
    resolved = resolve_precision(PrecisionConfig("int8", passes=FusedPasses(try_compile=False)), torch.device("cpu"))
    assert resolved.config_in_use.mode == "int8", resolved.note
    return resolved.config_in_use


@pytest.fixture(scope="module")
def user_net_class(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "user_net.py"
    path.write_text(USER_MODEL)
    spec = importlib.util.spec_from_file_location("user_net", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.UserNet


def _resnet18():
    return torchvision.models.resnet18(num_classes=10)


def _mobilenet():
    return torchvision.models.mobilenet_v3_small(num_classes=10)


def _seeded(make):
    torch.manual_seed(0)
    return make()


def _product_params(model):
    """{name: Parameter} of every Conv2d / Linear."""
    return {f"{m_name}.{p_name}": p for m_name, m in model.named_modules() if type(m) in (nn.Conv2d, nn.Linear)
            for p_name, p in m.named_parameters(recurse=False)}


def _leftovers(conversion):
    return {row.name: row.before for row in conversion.leftovers}


# ---- structure: parameters kept, leftovers exact ---------------------------------------------------------------------

@pytest.mark.parametrize("make, leftovers", [(_resnet18, RESNET18_LEFTOVERS), (_mobilenet, MOBILENET_LEFTOVERS)],
                         ids=["resnet18", "mobilenet_v3_small"])
def test_torchvision_conv_linear_parameters_kept_and_leftovers_listed(make, leftovers):
    model = _seeded(make)
    before = {name: (p, p.detach().clone()) for name, p in _product_params(model).items()}
    bn_params = [f"{n}.{p}" for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d) for p in ("weight", "bias")]
    conversion = convert(model, PrecisionConfig("int8"))
    after = dict(conversion.model.named_parameters())
    for name, (param, value) in before.items():
        assert after[name] is param and torch.equal(after[name], value)
    assert _leftovers(conversion) == leftovers
    assert all(row.reason for row in conversion.leftovers)
    assert sorted(conversion.params_removed) == sorted(bn_params)
    assert {n.rsplit(".", 1)[-1] for n in conversion.params_added} <= {"v", "gamma", "beta"}
    products = [m for m in conversion.model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert products and all(isinstance(m, (QConv2d, QLinear)) for m in products)


def test_mobilenet_norms_fold_their_activation_and_projections_stay_linear():
    conversion = convert(_seeded(_mobilenet), PrecisionConfig("int8"))
    modules = dict(conversion.model.named_modules())
    rows = {row.name: row for row in conversion.rows}
    # conv, bn, act of the first Conv2dNormActivation: one Range EvoNorm, the Hardswish slot an Identity
    assert isinstance(modules["features.0.1"], RangeEvoNorm) and isinstance(modules["features.0.2"], nn.Identity)
    assert rows["features.0.2"].status == "folded"
    # the linear bottleneck's projection (conv, bn: no activation) gets the norm without its activation
    assert isinstance(modules["features.1.block.2.1"], RangeEvoNormLinear)
    assert "v" not in dict(modules["features.1.block.2.1"].named_parameters())
    # the SE block's activations are modules: converted
    assert isinstance(modules["features.1.block.1.activation"], MaskReLU)
    assert isinstance(modules["features.1.block.1.scale_activation"], MaskHardsigmoid)
    assert isinstance(modules["classifier.1"], MaskHardswish)


def test_zero_initialised_residual_norm_stays_zero():
    conversion = convert(torchvision.models.resnet18(num_classes=10, zero_init_residual=True), FP32)
    norm = dict(conversion.model.named_modules())["layer1.0.bn2"]
    assert isinstance(norm, RangeEvoNormLinear) and torch.equal(norm.gamma, torch.zeros_like(norm.gamma))


@pytest.mark.parametrize("make", [_resnet18, _mobilenet], ids=["resnet18", "mobilenet_v3_small"])
def test_fp32_keep_is_numerically_identical(make):
    original = _seeded(make)
    conversion = convert(copy.deepcopy(original), FP32, norm="keep")
    model = conversion.model
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in original.named_parameters()]
    assert conversion.params_removed == conversion.params_added == ()
    x = torch.randn(2, 3, 32, 32)
    for m in (original, model):
        m.train() if make is _resnet18 else m.eval()  # mobilenet: its dropout would draw differently
    y_ref, y = original(x), model(x)
    assert torch.equal(y, y_ref)
    y_ref.square().sum().backward()
    y.square().sum().backward()
    for (name, p_ref), (_, p) in zip(original.named_parameters(), model.named_parameters()):
        assert torch.equal(p.grad, p_ref.grad), name


def test_user_model_from_a_file_outside_the_package(user_net_class):
    original = _seeded(user_net_class)
    model = copy.deepcopy(original)
    conversion = convert(model, PrecisionConfig("int8"))
    for name, p in _product_params(original).items():
        assert torch.equal(dict(conversion.model.named_parameters())[name], p)
    assert _leftovers(conversion) == USER_LEFTOVERS
    rows = {row.name: row for row in conversion.rows}
    assert (rows["stem.1"].after, rows["stem.2"].status) == ("RangeEvoNorm", "folded")
    assert (rows["dw_bn"].after, rows["act"].after) == ("RangeEvoNormLinear", "MaskHardswish")
    assert (rows["grouped"].after, rows["pool"].after, rows["head.3"].after) == ("QConv2d", "MaskMaxPool2d",
                                                                                  "MaskReLU6")
    assert model.grouped.padding == (1, 1)  # 'same' as the numbers 8-bit convolutions take
    assert rows["head.0"].status == "no compute"
    assert "padding_mode 'reflect'" in rows["smooth"].reason


# ---- multiply-adds ---------------------------------------------------------------------------------------------------

def test_macs_match_an_analytic_count(user_net_class):
    conversion = convert(_seeded(user_net_class), PrecisionConfig("int8"))
    macs = conversion.count_macs((1, 3, 16, 16))
    assert macs.error is None and macs.per_layer == USER_MACS
    assert macs.eight_bit == sum(USER_MACS.values()) - USER_MACS["smooth"]
    assert macs.share_8bit == pytest.approx(macs.eight_bit / sum(USER_MACS.values()))
    assert conversion.count_macs((4, 3, 16, 16)).total == 4 * macs.total
    text = conversion.render()
    assert text.splitlines()[-1].endswith(conversion.summary())
    assert f"{100 * macs.share_8bit:.1f}% of multiply-adds in 8-bit" in text


@pytest.mark.parametrize("make, share", [(_resnet18, 1.0), (_mobilenet, 1.0)], ids=["resnet18", "mobilenet_v3_small"])
def test_torchvision_macs_plausible_and_model_untouched(make, share):
    model = _seeded(make)
    conversion = convert(model, PrecisionConfig("int8"))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    macs = conversion.count_macs((1, 3, 224, 224))
    # published counts at 224x224: ResNet-18 1.82 G, MobileNetV3-Small 0.06 G multiply-adds
    expected = 1.82e9 if make is _resnet18 else 0.057e9
    assert macs.total == pytest.approx(expected, rel=0.05)
    assert macs.share_8bit == share
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert convert(make(), FP32).count_macs((1, 3, 224, 224)).share_8bit == 0.0


def test_model_converting_nothing_says_zero():
    model = nn.Sequential(nn.Conv1d(4, 8, 3), nn.GELU(), nn.LayerNorm(14))
    conversion = convert(model, PrecisionConfig("int8"))
    assert conversion.model(torch.randn(2, 4, 16)).shape == (2, 8, 14)
    conversion.count_macs((2, 4, 16))
    assert conversion.macs.total == 2 * 8 * 14 * 4 * 3
    assert "0 of 3 layers converted; 0.0% of multiply-adds in 8-bit" in conversion.render().splitlines()[-1]


# ---- int8 training: 1-byte saves -------------------------------------------------------------------------------------

def _saves_by_layer(conversion, x):
    """One training step; every tensor autograd saves in the forward pass (parameters and buffers left out), by the
    row (layer) running when it was saved - or the innermost container, for tensor ops in a forward method."""
    model = conversion.model.train()
    rows = {row.name for row in conversion.rows}
    names = {m: n for n, m in model.named_modules()}
    stack, saves = [], defaultdict(list)
    skip = {id(t) for t in chain(model.parameters(), model.buffers())}

    def owner(name):
        """The row ``name`` is, or is inside (a layer's quantizer), else the container ``name``."""
        parts = name.split(".")
        inside = [".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in rows]
        return inside[0] if inside else f"container {name}"

    def enter(module, args):
        stack.append(owner(names[module]))

    def leave(module, args, output):
        stack.pop()

    hooks = [h for m in model.modules() for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]

    def pack(t):
        if id(t) not in skip:
            saves[stack[-1] if stack else "outside"].append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(x), torch.arange(x.shape[0]) % 10)
    loss.backward()
    for h in hooks:
        h.remove()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    return saves


def _big_float_saves(saves):
    """Owners that saved a tensor of more than 1 element that is not 1-byte (fp32, int64 indices, ...)."""
    return {owner for owner, items in saves.items() if any(d.itemsize > 1 and n > 1 for d, n in items)}


@pytest.mark.parametrize("make, inline", [(_resnet18, set()), (_mobilenet, {f"container {se}" for se in SE_BLOCKS})],
                         ids=["resnet18", "mobilenet_v3_small"])
def test_int8_step_saves_only_bytes_in_converted_layers(int8, make, inline):
    conversion = convert(_seeded(make), int8)
    saves = _saves_by_layer(conversion, torch.randn(2, 3, 32, 32))
    converted = {row.name for row in conversion.rows if row.status == "converted"}
    assert converted & set(saves)  # the hooks saw the converted layers save
    for name in converted:
        assert all(d.itemsize == 1 or n <= 1 for d, n in saves.get(name, [])), (name, saves[name])
    # fp32 saves: tensor ops in a forward (MobileNetV3's SE block: scale * input) and the loss; the leftovers here
    # (global average pools) are means and save nothing
    assert _big_float_saves(saves) == inline | {"outside"}


def test_int8_step_user_model(int8, user_net_class):
    conversion = convert(_seeded(user_net_class), int8)
    saves = _saves_by_layer(conversion, torch.randn(2, 3, 16, 16))
    assert _big_float_saves(saves) == set(USER_LEFTOVERS) | {"outside"}
    for row in conversion.rows:
        if row.status == "converted":
            assert all(d.itemsize == 1 or n <= 1 for d, n in saves[row.name]), row.name


# ---- int8 == sim8 where the kernels are exact ------------------------------------------------------------------------

def _assert_int8_equals_sim8(sim, real, x):
    """test_lowp_layers.py's tolerance: outputs within one quantization step, gradients (same stochastic codes)
    allclose."""
    dy = torch.randn_like(sim(x))
    y_s, dx_s, dw_s, _ = forward_backward(sim, x, dy)
    y_i, dx_i, dw_i, _ = forward_backward(real, x, dy)
    assert (y_s - y_i).abs().max() <= product_step(x, sim.weight)
    assert torch.allclose(dx_s, dx_i, atol=1e-5, rtol=1e-4)
    assert torch.allclose(dw_s, dw_i, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name, shape", [
    ("features.0.0", (2, 3, 16, 16)),  # stem conv, stride 2
    ("features.1.block.0.0", (2, 16, 8, 8)),  # depthwise, stride 2
    ("features.1.block.1.fc1", (2, 16, 1, 1)),  # SE 1x1 conv with bias on 1x1 pixels
    ("features.2.block.0.0", (2, 16, 4, 4)),  # pointwise
    ("classifier.0", (2, 576)),
])
def test_converted_int8_layer_equals_sim8(int8, name, shape):
    original = _seeded(_mobilenet)
    sim = dict(convert(copy.deepcopy(original), SIM8).model.named_modules())[name]
    real = dict(convert(copy.deepcopy(original), int8).model.named_modules())[name]
    torch.manual_seed(1)
    _assert_int8_equals_sim8(sim, real, torch.randn(shape) * 2 + 0.5)


@pytest.mark.parametrize("conv", [
    dict(in_channels=8, out_channels=8, kernel_size=3, padding=1, groups=8),  # depthwise
    dict(in_channels=8, out_channels=8, kernel_size=5, stride=2, padding=2, groups=8),  # depthwise 5x5, stride 2
    dict(in_channels=8, out_channels=12, kernel_size=3, padding=1, groups=4),  # grouped
    dict(in_channels=8, out_channels=16, kernel_size=3, padding=2, dilation=2, groups=2),  # grouped, dilated
], ids=["depthwise", "depthwise-5x5-s2", "grouped", "grouped-dilated"])
def test_grouped_and_depthwise_int8_forward_backward_equal_sim8(int8, conv):
    torch.manual_seed(0)
    original = nn.Sequential(nn.Conv2d(**conv))
    sim = convert(copy.deepcopy(original), SIM8).model[0]
    real = convert(copy.deepcopy(original), int8).model[0]
    assert isinstance(real, QConv2d) and real.groups == conv["groups"]
    torch.manual_seed(1)
    _assert_int8_equals_sim8(sim, real, torch.randn(3, 8, 9, 9) * 2 + 0.5)


# ---- mask activations ------------------------------------------------------------------------------------------------

ACTIVATIONS = {"relu": (MaskReLU, nn.ReLU), "relu6": (MaskReLU6, nn.ReLU6),
               "hardsigmoid": (MaskHardsigmoid, nn.Hardsigmoid), "hardswish": (MaskHardswish, nn.Hardswish)}


def _activation_input():
    """Random values over [-8, 8] plus every kink of these activations, exactly."""
    torch.manual_seed(0)
    x = torch.rand(4, 3, 16, 16) * 16 - 8
    x.view(-1)[:6] = torch.tensor([-3.0, 0.0, 3.0, 6.0, -3.0 + 1e-6, 3.0 - 1e-6])
    return x


def _value_and_grad(layer, x, g):
    leaf = x.clone().requires_grad_()
    y = layer(leaf * 1.0)  # a non-leaf input, as inside a model (in-place layers may overwrite it)
    y.backward(g)
    return y.detach(), leaf.grad


@pytest.mark.parametrize("kind", ACTIVATIONS)
@pytest.mark.parametrize("mode", ["fp32", "sim8"])
@pytest.mark.parametrize("inplace", [False, True])
def test_mask_activation_is_torch_in_fp32_and_sim8(kind, mode, inplace):
    mask, plain = ACTIVATIONS[kind]
    x, g = _activation_input(), torch.randn(4, 3, 16, 16)
    y, dx = _value_and_grad(mask(PrecisionConfig(mode), inplace=inplace), x, g)
    y_ref, dx_ref = _value_and_grad(plain(inplace=inplace), x, g)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    z = x.clone()
    assert (mask(PrecisionConfig(mode), inplace=inplace)(z) is z) == inplace  # in place as torch


@pytest.mark.parametrize("kind", ACTIVATIONS)
@pytest.mark.parametrize("inplace", [False, True])
def test_mask_activation_int8_saves_one_byte_and_gives_torch_gradients(kind, inplace):
    mask, plain = ACTIVATIONS[kind]
    x, g = _activation_input(), torch.randn(4, 3, 16, 16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y, dx = _value_and_grad(mask(PrecisionConfig("int8"), inplace=inplace), x, g)
    assert [(t.dtype.itemsize, t.numel()) for t in saved] == [(1, x.numel())]
    y_ref, dx_ref = _value_and_grad(plain(), x, g)
    assert torch.equal(y, y_ref)
    if kind != "hardswish":
        assert torch.equal(dx, dx_ref)
        return
    outside = x.abs() >= 3
    assert torch.equal(dx[outside], dx_ref[outside])
    error = (dx - dx_ref).abs()
    assert (error <= g.abs() / HARDSWISH_BINS + 1e-6).all()  # the documented bound
    assert error.max() > 0  # a 1-byte code of the slope, not the slope


@pytest.mark.parametrize("geometry", [
    dict(kernel_size=3, stride=2, padding=1),  # ResNet stem: overlapping, padded
    dict(kernel_size=2, stride=1),
    dict(kernel_size=(2, 3), stride=(1, 2), padding=(1, 0)),
    dict(kernel_size=2, stride=3),  # gaps between windows
    dict(kernel_size=2),  # non-overlapping: the fused path
], ids=["3s2p1", "2s1", "rect", "gaps", "2"])
def test_mask_max_pool_any_stride_and_padding_is_torch_bit_for_bit(geometry):
    pool = nn.MaxPool2d(**geometry)
    mask = convert(nn.Sequential(pool), PrecisionConfig("int8")).model[0]
    torch.manual_seed(0)
    x = torch.randn(2, 3, 11, 10).relu()  # ties: windows of zeros, and maxima shared by overlapping windows
    g = torch.randn_like(pool(x))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y, dx = _value_and_grad(mask, x, g)
    assert [(t.dtype, t.numel()) for t in saved] == [(torch.uint8, g.numel())]  # one byte per output element
    y_ref, dx_ref = _value_and_grad(pool, x, g)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)


# ---- activation-free norms -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("formula, backward", [(range_evonorm_linear, range_evonorm_linear_backward),
                                               (evonorm_s0_linear, evonorm_s0_linear_backward)])
def test_linear_norm_backward_is_autograds(formula, backward):
    torch.manual_seed(0)
    x = torch.randn(3, 8, 5, 5, dtype=torch.float64)
    x[0, 0, 0, 0] = x[0, 0, 0, 1] = x[0, :2].max() + 1  # a tie at a group's maximum
    v, gamma, beta = (torch.randn(1, 8, 1, 1, dtype=torch.float64) for _ in range(3))
    g = torch.randn_like(x)
    leaves = [t.clone().requires_grad_() for t in (x, gamma, beta)]
    want = torch.autograd.grad(formula(leaves[0], v, leaves[1], leaves[2], 4, 1e-5), leaves, g)
    dx, dv, d_gamma, d_beta = backward(x, v, gamma, beta, 4, 1e-5, g)
    for got, ref in zip((dx, d_gamma, d_beta), want):
        assert torch.allclose(got, ref, atol=1e-10)
    assert not dv.any()
    # linear in x for fixed statistics: doubling x leaves it unchanged but for beta
    y = formula(x, v, gamma, torch.zeros_like(beta), 4, 0.0)
    assert torch.allclose(formula(2 * x, v, gamma, torch.zeros_like(beta), 4, 0.0), y)


@pytest.mark.parametrize("norm", [RangeEvoNormLinear, EvoNormS0Linear])
def test_linear_norm_int8_equals_sim8_and_saves_codes(norm):
    torch.manual_seed(0)
    sim, real = norm(16, 4, precision=SIM8), norm(16, 4, precision=PrecisionConfig("int8"))
    assert [n for n, _ in real.named_parameters()] == ["gamma", "beta"] and "v" not in real.state_dict()
    with torch.no_grad():
        sim.gamma.uniform_(0.5, 1.5)
    real.load_state_dict(sim.state_dict())
    x = torch.randn(2, 16, 6, 6) * 2 + 0.5
    g = torch.randn_like(x)
    saved = []
    y_s, dx_s = _value_and_grad(sim, x, g)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y_i, dx_i = _value_and_grad(real, x, g)
    assert [t.dtype for t in saved if t.numel() == x.numel()] == [torch.uint8]
    assert torch.allclose(y_s, y_i, atol=1e-5) and torch.allclose(dx_s, dx_i, atol=1e-4)


# ---- rules -----------------------------------------------------------------------------------------------------------

def test_hooks_subclasses_and_shared_modules():
    class MyConv(nn.Conv2d):
        pass

    hooked = nn.Conv2d(3, 4, 3)
    hooked.register_forward_pre_hook(lambda module, args: None)
    parametrized = torch.nn.utils.parametrizations.weight_norm(nn.Conv2d(4, 4, 1))  # a generated Conv2d subclass
    shared = nn.ReLU()
    model = nn.Sequential(hooked, MyConv(4, 4, 3), parametrized, shared, nn.Conv2d(4, 4, 1), shared)
    conversion = convert(model, PrecisionConfig("int8"))
    assert set(_leftovers(conversion)) == {"0", "1", "2"}
    assert "hooks" in conversion.rows[0].reason
    assert "subclass" in conversion.rows[1].reason and "parametrized" in conversion.rows[2].reason
    assert model[3] is model[5] and isinstance(model[3], MaskReLU)
    assert [row.name for row in conversion.rows] == ["0", "1", "2", "3", "4"]  # the shared ReLU once


def test_batchnorm_choices():
    def make():
        return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8))

    bn = convert(make(), SIM8, norm="batchnorm")
    assert type(bn.model[1]).__name__ == "BatchNormAct" and isinstance(bn.model[2], nn.Identity)
    assert "1.bn.weight" in bn.params_added and _leftovers(bn) == {"4": "BatchNorm2d"}
    keep = convert(make(), SIM8, norm="keep")
    assert _leftovers(keep) == {"1": "BatchNorm2d", "4": "BatchNorm2d"} and isinstance(keep.model[2], MaskReLU)
    s0 = convert(make(), SIM8, norm="evonorm")
    assert [type(m).__name__ for m in s0.model] == ["QConv2d", "EvoNormS0", "Identity", "QConv2d", "EvoNormS0Linear"]
    with pytest.raises(ValueError):
        convert(make(), SIM8, norm="layernorm")


def test_hand_written_model_and_single_layer():
    model = build_model("resnet20", precision=SIM8)
    names = [n for n, _ in model.named_parameters()]
    conversion = convert(model, SIM8)
    assert [n for n, _ in conversion.model.named_parameters()] == names
    assert {row.status for row in conversion.rows} == {"low-precision", "kept", "no compute"}
    assert _leftovers(conversion) == {"pool": "AdaptiveAvgPool2d"}
    linear = nn.Linear(4, 2)
    single = convert(linear, SIM8)
    assert isinstance(single.model, QLinear) and single.model.weight is linear.weight


def test_render_is_compact():
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(30)], nn.SiLU())
    conversion = convert(model, SIM8)
    conversion.count_macs((2, 8))
    lines = conversion.render(max_rows=5).splitlines()
    assert lines[1].split()[:4] == ["30x", "0", "..", "29"]  # identical consecutive rows merged
    assert lines[-1].endswith("30 of 31 layers converted; 100.0% of multiply-adds in 8-bit (3.84k MACs at input 2x8); "
                              "fp32 leftovers: SiLU 30 (activation without a 1-byte form here (its gradient reads the "
                              "fp32 input or output))")
