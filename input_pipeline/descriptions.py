"""Stable, content-based descriptions of data sources, and what differs between two of them.

Grain stores `repr(data_source)` in the data-iterator state of every checkpoint and refuses to
restore it onto a loader whose source's repr differs (grain `DataLoader._validate_state`). A
description is a JSON object: the source's `kind` and the facts that decide its records (the
resolved path and a fingerprint of the files' paths, sizes and modification times; a TFDS
dataset's name, version and split; image settings), never an object id, so the same data
describes itself the same way in every process and after a restart, and `difference` can say
which of those facts changed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def describe(kind: str, **fields: Any) -> str:
    """The description of a source of `kind`; field names that are settings are written as
    such (`data.source`, `examples.host_crop_size`)."""
    return json.dumps({"kind": kind, **fields})


def difference(saved: str, current: str) -> str | None:
    """The first fact that differs between two descriptions, as `name: saved vs current`
    (None when they are equal); descriptions written before these (object reprs) are compared
    whole."""
    if saved == current:
        return None
    try:
        old, new = json.loads(saved), json.loads(current)
    except ValueError:
        old = new = None
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return f"data source: {saved[:120]} vs {current[:120]}"
    for key in dict.fromkeys([*new, *old]):
        if old.get(key) != new.get(key):
            return f"{key}: {old.get(key)!r} vs {new.get(key)!r}"
    return None


def files_fingerprint(root: Path, files: Sequence[Path], labels: Sequence[Any]) -> str:
    """A digest of files' paths relative to `root`, sizes, modification times and labels: it
    changes when a file is added, removed, renamed, relabelled or edited."""
    digest = hashlib.sha1()
    for path, label in zip(files, labels, strict=True):
        stat = path.stat()
        digest.update(json.dumps([str(path.relative_to(root)), stat.st_size, stat.st_mtime_ns,
                                  label]).encode())
    return digest.hexdigest()[:16]
