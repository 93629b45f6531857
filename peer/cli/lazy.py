"""A click group whose commands are imported only when one of them runs or shows its own help.

``lpdl-peer --help`` lists every command from the one-line summaries registered here, without importing any command
module; ``lpdl-peer <cmd> ...`` imports that command's module alone. Together with command modules that keep their
heavy imports (torch, grpc, zeroconf) inside the command bodies, this keeps ``--help`` and ``status`` light.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import click


@dataclass(frozen=True)
class LazyCommand:
    """Where a command lives and how the command list summarises it.

    Attributes:
        module: dotted module path holding the click command.
        attr: name of the command object in that module.
        summary: one line for ``lpdl-peer --help`` (the command's docstring stays its full help).
    """

    module: str
    attr: str
    summary: str


class LazyGroup(click.Group):
    """A :class:`click.Group` whose commands are all :class:`LazyCommand` entries, imported on first use."""

    def __init__(self, *args: Any, lazy: dict[str, LazyCommand], **kwargs: Any) -> None:  # click.Group's own
        super().__init__(*args, **kwargs)
        self.lazy = lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(self.lazy)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = self.lazy.get(cmd_name)
        if entry is None:
            return None
        command = getattr(importlib.import_module(entry.module), entry.attr)
        if not isinstance(command, click.Command):
            raise TypeError(f"{entry.module}.{entry.attr} is not a click command")
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command list from the registered summaries (no command module is imported)."""
        with formatter.section("Commands"):
            formatter.write_dl([(name, self.lazy[name].summary) for name in self.list_commands(ctx)])
