"""A text corpus as input shards that workers read independently (`prepare.prepare_text`).

A shard is a few MB of the corpus (`data.input_shard_mb`) and depends only on the files (their
sorted paths and sizes), never on the number of workers or hosts:
- Files larger than a shard are cut at nominal offsets k x size; the reader of a piece starts at
  the first document boundary at or after its nominal start and stops at the first one at or
  after its nominal end, so neighbouring pieces meet exactly. A boundary is a blank line (plain
  text: documents are separated by blank lines) or a level-1 ` = Title = ` line (WikiText),
  looked for within one shard size; where a document is longer than that, the piece is cut at a
  line start instead (the document is split; say so in a corpus of huge documents).
- Smaller files are grouped, in order, until a shard's size is reached.
- A TFDS text dataset is cut into ranges of `TFDS_RECORDS_PER_SHARD` records (one record is a
  document), read by random access (`sources.open_tfds`: prepared ArrayRecord, no TensorFlow).
- The offline demo corpus into ranges of `DEMO_DOCUMENTS_PER_SHARD` documents.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import sources

DEMO_CORPUS = "python-docs"
TFDS_RECORDS_PER_SHARD = 4096
DEMO_DOCUMENTS_PER_SHARD = 128
_WIKITEXT_TITLE = re.compile(rb"^ = [^=].* = $")


@dataclasses.dataclass(frozen=True)
class Piece:
    """A byte range [start, stop) of a file (nominal ends, see the module docstring), a record
    range of a TFDS split, or a document range of the demo corpus."""

    path: str
    start: int
    stop: int


@dataclasses.dataclass(frozen=True)
class InputShard:
    """One unit of preparation: its position in the corpus, where it reads, and an identity
    (paths, sizes, modification times) that changes when what it reads changes."""

    index: int
    kind: str  # "files", "tfds" or "demo"
    pieces: tuple[Piece, ...]
    text_format: str
    identity: str

    @property
    def size(self) -> int:
        """Nominal bytes (files), or records / documents, for progress reports."""
        return sum(p.stop - p.start for p in self.pieces)


def source_items(spec: str) -> list[str]:
    """The sources a `data.source` names: its comma-separated items (XLM's and MASS's
    `en=wiki.en,de=wiki.de`, a parallel corpus's `train.en,train.de`), each without its `LANG=`
    prefix unless the whole item is a path that exists."""
    items = []
    for item in (part.strip() for part in spec.split(",")):
        language, equals, rest = item.partition("=")
        if equals and "/" not in language and not Path(item).exists():
            item = rest
        if item:
            items.append(item)
    return items


def missing_paths(spec: str) -> list[str]:
    """The items of `spec` (`source_items`) that name a file or folder (a `/` or `.` in them;
    not tfds:NAME, a glob or a demo's name such as python-docs) that does not exist: checked
    before anything heavy is imported."""
    return [item for item in source_items(spec)
            if any(c in item for c in "/.") and not item.startswith("tfds:")
            and not any(c in item for c in "*?[") and not Path(item).exists()]


def read_files_identity(spec: str, tfds_data_dir: str = "") -> tuple[int, list[Any]]:
    """(how many files, what identifies them) of what a corpus `spec` reads, item by item
    (`source_items`): the paths, sizes and modification times of the files a text reader reads
    (`sources.text_files`: a folder's `*.txt` files), a TFDS dataset's or the demo corpus's
    `source_fingerprint`. Missing paths count as no files (preparation says so)."""
    identities: list[Any] = []
    files = 0
    for item in source_items(spec):
        if item == DEMO_CORPUS or item.startswith("tfds:"):
            identities.append(source_fingerprint(item, tfds_data_dir))
            continue
        paths = sources.text_files(item)
        files += len(paths)
        identities.append([_file_identity(p) for p in paths])
    return files, identities


def source_fingerprint(spec: str, tfds_data_dir: str = "") -> Any:
    """Paths with their sizes and mtimes (so edited files invalidate the cache): every file of a
    file, folder (recursively) or glob; a TFDS dataset's name, version and `dataset_info.json`
    digest (`sources.tfds_fingerprint`, read in `tfds_data_dir`); the demo corpus's name."""
    if spec == DEMO_CORPUS:
        return spec
    if spec.startswith("tfds:"):
        return [spec, sources.tfds_fingerprint(sources.tfds_builder(spec[5:],
                                                                    tfds_data_dir or None))]
    paths = ([Path(spec)] if Path(spec).exists() or not any(c in spec for c in "*?[")
             else [Path(p) for p in sorted(glob.glob(spec, recursive=True))])
    files = [q for p in paths for q in (sorted(p.rglob("*")) if p.is_dir() else [p])]
    return [_file_identity(p) for p in files if p.is_file()]


def _file_identity(path: Path) -> list[Any]:
    stat = path.stat()
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


def plan_shards(spec: str, data: Any) -> list[InputShard]:
    """The corpus `spec` (a file, folder, glob, `tfds:NAME` or the demo corpus) as shards."""
    if spec == DEMO_CORPUS:
        return _ranges("demo", DEMO_CORPUS, len(_demo_documents()), DEMO_DOCUMENTS_PER_SHARD,
                       DEMO_CORPUS)
    if spec.startswith("tfds:"):
        name = spec[5:]
        source = sources.open_tfds(name, data.tfds_split, data.tfds_data_dir or None)
        count = len(source)
        if not count:
            raise UserError(f"TFDS {name} split {data.tfds_split} has no records; choose "
                            "another data.tfds_split")
        return _ranges("tfds", name, count, TFDS_RECORDS_PER_SHARD,
                       f"{source!r}:{data.tfds_data_dir}")
    if data.text_format not in ("auto", "plain", "wikitext"):
        raise UserError(f"data.text_format={data.text_format!r} is unknown; use auto, plain or "
                        "wikitext")
    paths = sources.expand_paths(spec)
    text_format = data.text_format
    if text_format == "auto":
        text_format = "wikitext" if sources.looks_like_wikitext(paths[0]) else "plain"
    shard_bytes = max(1, int(data.input_shard_mb * 2**20))
    groups: list[list[tuple[Piece, list[Any]]]] = [[]]
    group_bytes = 0
    for path in paths:
        identity = _file_identity(path)
        size = identity[1]
        if size > shard_bytes:
            if groups[-1]:
                groups.append([])
            for start in range(0, size, shard_bytes):
                groups[-1].append((Piece(str(path), start, min(start + shard_bytes, size)),
                                   identity))
                groups.append([])
            group_bytes = 0
            continue
        groups[-1].append((Piece(str(path), 0, size), identity))
        group_bytes += size
        if group_bytes >= shard_bytes:
            groups.append([])
            group_bytes = 0
    shards = [InputShard(i, "files", tuple(p for p, _ in group), text_format,
                         repr([(p, identity, shard_bytes) for p, identity in group]))
              for i, group in enumerate(g for g in groups if g)]
    if not any(shard.size for shard in shards):
        raise UserError(f"corpus {spec} is empty (no non-blank text); give a file with text")
    return shards


def _ranges(kind: str, name: str, count: int, size: int, identity: str) -> list[InputShard]:
    """Shards of `size` consecutive items (records or documents) of `count`."""
    return [InputShard(i, kind, (Piece(name, start, min(start + size, count)),), "",
                       f"{identity}:{count}")
            for i, start in enumerate(range(0, count, size))]


def read_shard(shard: InputShard, data: Any) -> Iterator[list[str]]:
    """The documents (lists of sentences) of one shard."""
    if shard.kind == "demo":
        piece = shard.pieces[0]
        yield from _demo_documents()[piece.start:piece.stop]
        return
    if shard.kind == "tfds":
        piece = shard.pieces[0]
        source = sources.open_tfds(piece.path, data.tfds_split, data.tfds_data_dir or None)
        key = None
        for index in range(piece.start, piece.stop):
            record = source[index]
            key = sources.tfds_text_key(record, piece.path, key or data.tfds_text_key or None)
            document = sources.tfds_document(record, key)
            if document:
                yield document
        return
    parse = (sources.wikitext_documents if shard.text_format == "wikitext"
             else sources.plain_text_documents)
    shard_bytes = max(1, int(data.input_shard_mb * 2**20))
    for piece in shard.pieces:
        yield from parse(read_piece_lines(piece, shard.text_format, shard_bytes))


def read_piece_lines(piece: Piece, text_format: str, window: int) -> list[str]:
    """The lines of a file piece, from the boundary at or after its start to the one at or
    after its stop (see the module docstring); a UserError names the file and byte offset of
    text that is not UTF-8 or cannot be read."""
    path = Path(piece.path)
    try:
        with path.open("rb") as handle:
            size = path.stat().st_size
            begin = boundary(handle, piece.start, text_format, window, size)
            end = boundary(handle, piece.stop, text_format, window, size)
            handle.seek(begin)
            raw = handle.read(max(0, end - begin))
    except OSError as e:
        raise UserError(f"cannot read corpus file {path} ({e.strerror}); fix its permissions "
                        "or remove it from data.source, then rerun (finished shards are "
                        "kept)") from None
    try:
        return raw.decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 (bad byte at offset {begin + e.start}); re-encode "
                        f"it (e.g. iconv -f latin1 -t utf-8) and rerun: finished shards are "
                        "kept") from None


def boundary(handle: BinaryIO, offset: int, text_format: str, window: int, size: int) -> int:
    """The first document start at or after `offset` within `window` bytes, else the first
    line start at or after it; 0 and `size` are boundaries."""
    if offset <= 0:
        return 0
    if offset >= size:
        return size
    handle.seek(offset - 1)
    if handle.read(1) != b"\n":
        handle.readline()
    first = position = handle.tell()
    while position < size and position - offset <= window:
        line = handle.readline()
        if _starts_document(line, text_format):
            return position
        position += len(line)
    return min(first, size)


def _starts_document(line: bytes, text_format: str) -> bool:
    if text_format == "wikitext":
        return bool(_WIKITEXT_TITLE.match(line.rstrip(b"\r\n")))
    return not line.strip()


@functools.cache
def _demo_documents() -> list[list[str]]:
    return sources.python_docs_documents()
