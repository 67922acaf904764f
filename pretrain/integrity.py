"""What makes a workdir trustworthy: sealed checkpoints and one writer at a time.

- A finished checkpoint is *sealed*: `checksums.json` beside its files holds the size and CRC-32
  of every file (zlib's, about 6 GB/s on one core). Restoring verifies the seal first; a file
  that is missing, resized or changed makes the checkpoint unreadable, and the trainer falls
  back to the previous one. A checkpoint without a seal (written before sealing existed, or
  killed between Orbax's finalisation and the seal) is restored as it is.
- `WorkdirLock`: an exclusive OS lock (`flock`) on the workdir folder itself, so it writes
  nothing and is released by the kernel when its process exits or dies; `owner.json` names
  the holder for the error a second training process gets.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pretext_jax.errors import UserError

CHECKSUM_FILE = "checksums.json"
OWNER_FILE = "owner.json"
_CHUNK = 16 << 20


def file_crc32(path: Path) -> int:
    """CRC-32 of a file, read in 16 MB chunks (memory does not grow with the file)."""
    crc = 0
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != CHECKSUM_FILE)


def seal(directory: Path) -> None:
    """Writes `checksums.json` (size and CRC-32 per file, paths relative to `directory`),
    atomically: a seal is whole or absent."""
    entries = {str(p.relative_to(directory)): [p.stat().st_size, file_crc32(p)]
               for p in _files(directory)}
    temporary = directory / f".{CHECKSUM_FILE}.tmp"
    temporary.write_text(json.dumps({"crc32": entries}, indent=0, sort_keys=True))
    os.replace(temporary, directory / CHECKSUM_FILE)


def is_sealed(directory: Path) -> bool:
    return (directory / CHECKSUM_FILE).is_file()


def verify(directory: Path, within: Sequence[str] = ()) -> str | None:
    """None when `directory` matches its seal (or has none); else what differs, naming the
    first file that is missing, resized, changed or unexpected. `within`: only the files under
    these sub-folders (e.g. a checkpoint's small `config` and `data` items)."""
    seal_file = directory / CHECKSUM_FILE
    if not seal_file.is_file():
        return None
    try:
        expected: dict[str, Any] = json.loads(seal_file.read_text())["crc32"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{seal_file.name} is damaged"
    present = {str(p.relative_to(directory)): p for p in _files(directory)}
    if within:
        inside = tuple(f"{folder}/" for folder in within)
        expected = {name: entry for name, entry in expected.items() if name.startswith(inside)}
        present = {name: path for name, path in present.items() if name.startswith(inside)}
    for name, (size, crc) in sorted(expected.items()):
        path = present.get(name)
        if path is None:
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} when written"
        if file_crc32(path) != crc:
            return f"{name} differs from what was written (CRC-32 mismatch)"
    extra = sorted(set(present) - set(expected))
    return f"{extra[0]} was not part of the checkpoint" if extra else None


class WorkdirLock:
    """One training process per workdir: an exclusive, non-blocking `flock` on the folder,
    held until `release` or the process's end (a crash releases it too)."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.workdir, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UserError(f"workdir {self.workdir} is in use by {self._holder()}; wait for "
                            "it to finish, stop it, or use another --workdir") from None
        self._fd = fd

    def _holder(self) -> str:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            owner = json.loads((self.workdir / OWNER_FILE).read_text())
            return (f"process {owner['pid']} on {owner['host']} (started "
                    f"{owner['started']})")
        return "another process"

    def record_owner(self) -> None:
        """Names this process in `owner.json` (once the run is allowed to write)."""
        temporary = self.workdir / f".{OWNER_FILE}.tmp"
        temporary.write_text(json.dumps({
            "pid": os.getpid(), "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv}))
        os.replace(temporary, self.workdir / OWNER_FILE)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None
