"""Markdown rows for docs/benchmarks.md and docs/testing.md, one format for every bench script.

Every figure in README.md and docs/ is a cell of a row that a command in `bench/` wrote with
`write_row`: the benchmark's own cells, then the machine it ran on, the date and the exact
command. A script prints its row (a line starting with `| `) and appends it to its `--markdown`
file, which starts with the table's header when the script creates it; the row is pasted from
there under the table of the same header in the docs (`tests/test_docs.py` checks that every
bench table in docs/ has the header its script writes).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TAIL = ("machine", "date", "command")


@dataclasses.dataclass(frozen=True)
class Table:
    """A benchmark's table: its own `columns`, then machine, date and command."""

    name: str
    columns: tuple[str, ...]

    @property
    def all_columns(self) -> tuple[str, ...]:
        return (*self.columns, *TAIL)

    def header(self) -> str:
        """The header line and the alignment line."""
        return (markdown_line(self.all_columns) + "\n"
                + "|" + " --- |" * len(self.all_columns))

    def row(self, cells: Sequence[Any], command: str, machine: str | None = None,
            date: str | None = None) -> str:
        """One row: `cells` (one per column) and the machine, date and command (in backticks);
        machine and date default to this machine (`machine()`) and today."""
        if len(cells) != len(self.columns):
            raise ValueError(f"{self.name}: {len(cells)} cells for the columns {self.columns}")
        return markdown_line([*map(cell, cells), cell(machine or this_machine()),
                              date or time.strftime("%Y-%m-%d"), f"`{cell(command)}`"])


def cell(value: Any) -> str:
    """A table cell: None is `-`, floats get 3 decimals, `|` is escaped and lines joined."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value).replace("|", "\\|").replace("\n", " ").strip()


def markdown_line(cells: Sequence[str]) -> str:
    """`| a | b |` from cells already made (`cell`)."""
    return "| " + " | ".join(cells) + " |"


def figures(values: dict[str, Any], digits: int = 3) -> str:
    """`name value, name value, ...` in key order: a cell for a dict of metrics."""
    return ", ".join(f"{key} {value:.{digits}f}" if isinstance(value, float) else
                     f"{key} {value}" for key, value in sorted(values.items()))


def this_machine(devices: bool = True) -> str:
    """This machine in a cell: cores, architecture, memory, the JAX devices and version (when
    `devices`; host-only benchmarks leave JAX out) and the 1-minute load average, since the
    development machines are shared and wall-clock figures depend on it."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    parts = [f"{os.cpu_count()}-core {platform.machine()}, {memory:.0f} GiB"]
    if devices:
        import jax

        parts.append(f"{jax.device_count()} x {jax.devices()[0].device_kind}, "
                     f"jax {jax.__version__}")
    parts.append(f"load {os.getloadavg()[0]:.1f}")
    return ", ".join(parts)


def command_line(module: str, argv: Sequence[str] | None) -> str:
    """The command that ran: `python -m bench.NAME ARGS` (`argv` None: this process's)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python -m", module, *map(shlex.quote, args)])


def add_markdown_argument(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--markdown", default=f"runs/bench/{name}.md",
                        help="append the Markdown row(s) here (default %(default)s)")


def write_row(table: Table, cells: Sequence[Any], command: str, path: str | Path | None,
              devices: bool = True, machine: str | None = None, date: str | None = None
              ) -> str:
    """Formats the row (machine: `this_machine(devices)` unless given; date: today unless
    given), prints it and appends it to `path` (with the header when the file is new or
    empty); returns the row."""
    line = table.row(cells, command, machine=machine or this_machine(devices), date=date)
    print(line, flush=True)
    if path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists() or path.stat().st_size == 0
        with path.open("a", encoding="utf-8") as out:
            out.write((table.header() + "\n" if new else "") + line + "\n")
    return line
