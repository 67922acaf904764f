"""Progress of the long phases outside the training steps: feature banks, kNN votes, linear
probes, clustering. One tqdm helper for all of them: on stderr, shown only on a terminal and only
once a phase has lasted `DELAY_S` seconds (short phases print nothing), cleared when it ends.

It lives at the package root, below every layer like `errors.py`, so that `objectives/` can use
it without importing `pretrain/`; the trainer's metric writer switches it off for a run with
`train.progress=false` (`set_enabled`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TextIO, TypeVar

from tqdm import tqdm

T = TypeVar("T")

DELAY_S = 3.0
"""A phase shows its bar once it has lasted this long."""
_enabled = True


def set_enabled(enabled: bool) -> None:
    """Shows (on a terminal) or hides the phases' bars from now on (`train.progress`)."""
    global _enabled
    _enabled = enabled


def progress(items: Iterable[T], description: str, *, total: int | None = None,
             unit: str = "it", file: TextIO | None = None) -> Iterator[T]:
    """`items`, with a progress bar named `description` on `file` (stderr) while they are
    consumed: hidden when disabled, when `file` is no terminal or for the first `DELAY_S`."""
    return iter(tqdm(items, desc=description, total=total, unit=unit,
                     file=file or sys.stderr, leave=False, delay=DELAY_S, dynamic_ncols=True,
                     disable=None if _enabled else True))  # None: hidden unless a terminal
