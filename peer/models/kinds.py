"""Where a model comes from, parsed without importing torch (config and CLI validate ``--model`` with it).

``--model`` (``[model] name``) is one of:

* a registry name (``mnist-cnn``, ``resnet20``, ...): the hand-written 8-bit architectures of peer/models;
* ``torchvision:NAME``: a torchvision classification builder (``torchvision:mobilenet_v3_small``), converted;
* ``MODULE:CALLABLE``: a callable of an importable module (``my_pkg.nets:make_net``), converted;
* ``path/to/file.py:CALLABLE``: a callable defined in a Python file, converted.

The callables return an ``nn.Module``; they are called with ``num_classes`` and ``in_channels`` where they accept
them. The Python API (peer/api.py) also takes a callable itself: its source is ``python``.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Hand-written architectures of peer/models, by registry name (peer/models/registry.py builds them).
REGISTRY_MODELS = ("mnist-cnn", "resnet20", "resnet54", "vgg11", "resnet18")
#: Kinds of model source: the registry, torchvision, a module, a file, or a Python callable given in code.
MODEL_SOURCES = ("registry", "torchvision", "module", "file", "python")
#: Norm choice of a converted (plug-in) model that keeps its own BatchNorm layers.
KEEP_NORM = "keep"

_FORMS = ("a registry name (" + ", ".join(REGISTRY_MODELS) + "), torchvision:NAME, MODULE:CALLABLE or "
          "path/to/file.py:CALLABLE")


@dataclass(frozen=True)
class ModelRef:
    """A parsed ``--model`` value.

    Attributes:
        kind: one of MODEL_SOURCES (``python:NAME`` names a callable given in code, which only the Python API can
            build).
        target: registry name, torchvision builder name, module name or file path.
        attr: the callable's name (empty for the registry and torchvision).
    """

    kind: str
    target: str
    attr: str = ""

    def __str__(self) -> str:
        if self.kind == "registry":
            return self.target
        if self.kind in ("torchvision", "python"):
            return f"{self.kind}:{self.target if self.kind == 'torchvision' else self.attr}"
        return f"{self.target}:{self.attr}"


def parse_model_ref(ref: str) -> ModelRef:
    """Parse a ``--model`` value; a malformed one raises ValueError naming the forms accepted."""
    text = ref.strip()
    if ":" not in text:
        if text in REGISTRY_MODELS:
            return ModelRef("registry", text)
        raise ValueError(f"expected {_FORMS}, got {ref!r}")
    target, _, attr = text.rpartition(":")
    if target == "python" and attr.isidentifier():
        return ModelRef("python", "python", attr)
    if target == "torchvision":
        if not attr.isidentifier():
            raise ValueError(f"torchvision:NAME needs a builder name such as torchvision:resnet18, got {ref!r}")
        return ModelRef("torchvision", attr)
    if not target or not attr.isidentifier():
        raise ValueError(f"expected {_FORMS}, got {ref!r}")
    if target.endswith(".py") or "/" in target:
        return ModelRef("file", target, attr)
    if not all(part.isidentifier() for part in target.split(".")):
        raise ValueError(f"{target!r} is neither a module name nor a .py file; expected {_FORMS}")
    return ModelRef("module", target, attr)


def parse_options(entries: tuple[str, ...]) -> dict[str, object]:
    """``("width_mult=0.5", "dropout=0.1")`` -> keyword options; values as Python literals where they parse
    (numbers, booleans, None, tuples), else the text. A malformed entry raises ValueError naming it."""
    import ast

    options: dict[str, object] = {}
    for entry in entries:
        key, sep, value = entry.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ValueError(f"expected KEY=VALUE entries, got {entry!r}")
        try:
            options[key] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            options[key] = value.strip()
    return options
