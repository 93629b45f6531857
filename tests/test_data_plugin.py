"""A user's own dataset (--dataset MODULE:CALLABLE or file.py:CALLABLE): the forms it may return, what is inferred,
and the one-line errors for what cannot be used."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from peer.data import DatasetError, load_dataset
from peer.data.loader import BatchLoader


def _write(tmp_path: Path, body: str, name: str = "user_data.py") -> Path:
    path = tmp_path / "elsewhere" / name  # outside the package, in a directory of its own
    path.parent.mkdir(exist_ok=True)
    path.write_text(textwrap.dedent(body))
    return path


def test_tensor_pairs_uint8_infer_classes_shape_and_default_normalisation(tmp_path: Path) -> None:
    path = _write(tmp_path, """
        import torch
        def load():
            g = torch.Generator().manual_seed(0)
            x = torch.randint(0, 256, (40, 3, 12, 10), dtype=torch.uint8, generator=g)
            y = torch.arange(40) % 4
            return (x[:30], y[:30]), (x[30:], y[30:])
    """)
    splits = load_dataset(f"{path}:load")
    assert (splits.num_classes, splits.in_channels, splits.input_shape) == (4, 3, (3, 12, 10))
    assert splits.mean == (0.5,) * 3 and splits.std == (0.5,) * 3  # never computed from one device's data
    assert splits.name == f"{path}:load" and len(splits.train) == 30 and len(splits.test) == 10
    x, _ = next(iter(BatchLoader(splits.train, batch_size=30, mean=splits.mean, std=splits.std, shuffle=False)))
    assert x.min() >= -1.0 and x.max() <= 1.0
    raw = splits.train.images.float() / 255
    torch.testing.assert_close(x, (raw - 0.5) / 0.5)


def test_map_style_datasets_of_float_images_with_stated_normalisation_and_root(tmp_path: Path) -> None:
    path = _write(tmp_path, """
        import torch
        from torch.utils.data import Dataset

        class Pairs(Dataset):
            def __init__(self, n, offset):
                self.n, self.offset = n, offset
            def __len__(self):
                return self.n
            def __getitem__(self, i):
                return torch.full((8, 8), float(i + self.offset)), i % 3  # [H, W] greyscale floats

        def load(root):
            assert root == "DIR"
            return {"train": Pairs(9, 0), "test": Pairs(6, 100), "classes": ["a", "b", "c"], "mean": [1.0],
                    "std": 2.0}
    """)
    splits = load_dataset(f"{path}:load", root="DIR")
    assert splits.train.images.dtype == torch.float32 and splits.input_shape == (1, 8, 8)
    assert splits.classes == ("a", "b", "c") and splits.num_classes == 3
    assert splits.mean == (1.0,) and splits.std == (2.0,)
    x, y = next(iter(BatchLoader(splits.test, batch_size=6, mean=splits.mean, std=splits.std, shuffle=False)))
    assert float(x[1, 0, 0, 0]) == pytest.approx((101.0 - 1.0) / 2.0)  # float images are not scaled by 1/255
    assert y.tolist() == [0, 1, 2, 0, 1, 2]


def test_importable_module_form(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(tmp_path, """
        import torch
        def digits():
            x = torch.zeros(6, 1, 4, 4, dtype=torch.uint8)
            return (x, torch.tensor([0, 1, 0, 1, 0, 1])), (x[:2], torch.tensor([1, 0]))
    """, name="my_data_mod.py")
    monkeypatch.syspath_prepend(str(tmp_path / "elsewhere"))
    assert load_dataset("my_data_mod:digits").num_classes == 2


@pytest.mark.parametrize("body, message", [
    ("def load():\n    return 5\n", "returned int; expected (train, test)"),
    ("def load():\n    return {'train': 1}\n", "the dict lacks test"),
    ("import torch\ndef load():\n    x = torch.zeros(2, 1, 3, 3)\n    return (x, torch.tensor([0.5, 1.0])), (x, torch.tensor([0, 1]))\n",
     "labels must be integers"),
    ("import torch\ndef load():\n    x = torch.zeros(2, 1, 3, 3)\n    return (x, torch.tensor([0, 1])), (torch.zeros(2, 1, 4, 4), torch.tensor([0, 1]))\n",
     "train images torch.float32 (1, 3, 3) but test images torch.float32 (1, 4, 4)"),
    ("import torch\ndef load():\n    x = torch.zeros(2, 1, 3, 3)\n    return (x, torch.tensor([0, 1, 1])), (x, torch.tensor([0, 1]))\n",
     "2 images but 3 labels"),
    ("import torch\ndef load():\n    x = torch.zeros(2, 1, 3, 3)\n    return {'train': (x, torch.tensor([0, 5])), 'test': (x, torch.tensor([0, 1])), 'classes': ['a', 'b']}\n",
     "labels go up to 5 but 2 classes are named"),
    ("def load():\n    raise RuntimeError('no disk')\n", "calling it failed: RuntimeError: no disk"),
    ("import not_a_module_anywhere\n", "importing"),
    ("x = 1\n", "has no callable 'load'"),
])
def test_unusable_datasets_are_refused_in_one_line_naming_the_cause(tmp_path: Path, body: str, message: str) -> None:
    path = _write(tmp_path, body, name=f"bad_{abs(hash(body))}.py")
    with pytest.raises(DatasetError) as err:
        load_dataset(f"{path}:load")
    assert message in str(err.value) and f"{path}:load" in str(err.value) and "\n" not in str(err.value)


def test_missing_file_and_module_name_the_reference() -> None:
    with pytest.raises(DatasetError, match="file /nowhere/data.py not found"):
        load_dataset("/nowhere/data.py:load")
    with pytest.raises(DatasetError, match="cannot import module 'no_such_pkg_xyz'"):
        load_dataset("no_such_pkg_xyz:load")
