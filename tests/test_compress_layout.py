"""Layout: offsets, module order, digest stability, zero-copy views."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from peer.compress.layout import Layout, Segment

SHAPES = [("conv.weight", (4, 3, 3, 3)), ("norm.weight", (4,)), ("fc.weight", (10, 4)), ("fc.bias", (10,))]


def test_offsets_are_contiguous_in_order() -> None:
    layout = Layout.from_named_shapes(SHAPES)
    assert [s.offset for s in layout.segments] == [0, 108, 112, 152]
    assert layout.numel == 162
    assert layout.segments[2] == Segment("fc.weight", (10, 4), 112, 40)


def test_from_module_takes_parameters_only_in_named_parameters_order() -> None:
    module = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 10))
    layout = Layout.from_module(module)
    assert [s.name for s in layout.segments] == [n for n, _ in module.named_parameters()]
    assert "1.running_mean" not in [s.name for s in layout.segments]
    assert layout.numel == sum(p.numel() for p in module.parameters())


def test_digest_is_stable_and_sensitive_to_names_shapes_and_order() -> None:
    layout = Layout.from_named_shapes(SHAPES)
    # Pinned: a change here breaks compatibility with every deployed peer.
    assert layout.digest() == bytes.fromhex("035adcbcf9b8d3da")
    assert len(layout.digest()) == 8
    renamed = Layout.from_named_shapes([("conv.w", (4, 3, 3, 3))] + SHAPES[1:])
    reshaped = Layout.from_named_shapes([("conv.weight", (3, 4, 3, 3))] + SHAPES[1:])
    reordered = Layout.from_named_shapes(SHAPES[::-1])
    digests = {layout.digest(), renamed.digest(), reshaped.digest(), reordered.digest()}
    assert len(digests) == 4


def test_flatten_and_views_round_trip_zero_copy() -> None:
    layout = Layout.from_named_shapes(SHAPES)
    tensors = [torch.randn(shape) for _, shape in SHAPES]
    flat = layout.flatten(tensors)
    assert flat.dtype == torch.float32 and flat.shape == (layout.numel,)
    views = layout.views(flat)
    for t, v in zip(tensors, views):
        assert torch.equal(t, v)
    views[1][0] = 42.0
    assert flat[108] == 42.0  # a view, not a copy
    assert views[0].data_ptr() == flat.data_ptr()


def test_validation_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="duplicate segment name"):
        Layout.from_named_shapes([("a", (2,)), ("a", (3,))])
    with pytest.raises(ValueError, match="offset"):
        Layout((Segment("a", (2,), 1, 2),))
    with pytest.raises(ValueError, match="numel"):
        Layout((Segment("a", (2, 3), 0, 5),))
    layout = Layout.from_named_shapes(SHAPES)
    with pytest.raises(ValueError, match="shape"):
        layout.flatten([torch.zeros(1)] * 4)
    with pytest.raises(ValueError, match="tensors"):
        layout.flatten([])
    with pytest.raises(ValueError, match="elements"):
        layout.views(torch.zeros(5))
    with pytest.raises(ValueError, match="float32"):
        layout.views(torch.zeros(layout.numel, dtype=torch.float64))


def test_house_rule_compress_never_imports_the_network() -> None:
    import ast
    import pathlib

    import peer.compress

    for path in pathlib.Path(peer.compress.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
            for name in names:
                assert not name.startswith(("peer.net", "peer.node", "peer.gossip", "..net", "..node", "..gossip")), (path, name)
