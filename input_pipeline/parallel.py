"""Parallel text: line-aligned translations in two or more languages, streamed one aligned
line at a time (never the whole corpus in memory), for cross-lingual objectives (XLM's
translation language modelling, Lample & Conneau 2019 §3.3) and bilingual pre-training (MASS's
unsupervised translation setting, Song et al. 2019 §4.1).

Sources (`open_parallel`, `data.source`):

- line-aligned files, comma-separated: `train.en,train.de` (each file's language is its suffix,
  as Moses/fairseq name them) or `en=a.txt,de=b.txt` (named); line i of each file translates
  line i of the others (Multi30K: `train.en,train.de,train.fr`);
- one tab-separated file (`.tsv`) whose first line names the languages (`en<TAB>de`), one
  aligned sentence per column on every later line.

Files that disagree in length (or a TSV row with another number of columns) are a one-line
error naming them: a shifted file would silently pair every sentence with the wrong translation.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.descriptions import files_fingerprint

_LANGUAGE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,15}")


@dataclasses.dataclass(frozen=True)
class ParallelSource:
    """Aligned text in `languages`: `files` (one per language, or one TSV of all of them)."""

    languages: tuple[str, ...]
    files: tuple[Path, ...]

    @property
    def is_tsv(self) -> bool:
        return len(self.files) == 1

    def fingerprint(self) -> str:
        """Changes when a file is edited, renamed or assigned another language."""
        root = Path("/")
        return files_fingerprint(root, [p.resolve() for p in self.files],
                                 [",".join(self.languages)] * len(self.files))

    def __iter__(self) -> Iterator[dict[str, str]]:
        """{language: sentence} per aligned line, in order (whitespace at the ends stripped)."""
        return self._tsv_rows() if self.is_tsv else self._aligned_lines()

    def _aligned_lines(self) -> Iterator[dict[str, str]]:
        handles = [_open_text(path) for path in self.files]
        try:
            for count in itertools.count(1):
                lines = [_next_line(handle, path)
                         for handle, path in zip(handles, self.files, strict=True)]
                if all(line is None for line in lines):
                    return
                if None in lines:
                    raise UserError(_length_mismatch(self.files, handles, lines, count))
                yield dict(zip(self.languages, (line.strip() for line in lines), strict=True))
        finally:
            for handle in handles:
                handle.close()

    def _tsv_rows(self) -> Iterator[dict[str, str]]:
        path = self.files[0]
        with _open_text(path) as handle:
            _next_line(handle, path)  # the languages (read by `open_parallel`)
            for number in itertools.count(2):
                line = _next_line(handle, path)
                if line is None:
                    return
                cells = line.rstrip("\r\n").split("\t")
                if len(cells) != len(self.languages):
                    raise UserError(f"{path} line {number:,} has {len(cells)} tab-separated "
                                    f"columns, not {len(self.languages)} "
                                    f"({', '.join(self.languages)}); fix or remove that line")
                yield dict(zip(self.languages, (cell.strip() for cell in cells), strict=True))


def _open_text(path: Path) -> TextIO:
    return open(path, encoding="utf-8")  # noqa: SIM115 (closed by the caller)


def _next_line(handle: TextIO, path: Path) -> str | None:
    """The next line of `path`, or None at its end; bytes that are not UTF-8 are a UserError
    (text is decoded ahead in blocks, so it names the file, not the line)."""
    try:
        return next(handle, None)
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 (byte {e.object[e.start]:#04x}); re-encode it, "
                        f"e.g. iconv -f latin1 -t utf-8 {path.name}") from None


def _length_mismatch(files: tuple[Path, ...], handles: list[TextIO],
                     lines: list[str | None], count: int) -> str:
    """The error for files of different lengths: each file's line count."""
    counts = []
    for path, handle, line in zip(files, handles, lines, strict=True):
        total = count - 1 if line is None else count + sum(1 for _ in handle)
        counts.append(f"{path.name} {total:,}")
    return (f"parallel files must have the same number of lines, but {', '.join(counts)}; "
            "line i of each file must translate line i of the others")


def _language_of(item: str) -> tuple[str, Path]:
    """(language, path) of `LANG=PATH` or of a path whose suffix names the language."""
    if "=" in item and _LANGUAGE.fullmatch(item.split("=", 1)[0]):
        language, path = item.split("=", 1)
        return language, Path(path)
    path = Path(item)
    language = path.suffix.removeprefix(".")
    if not _LANGUAGE.fullmatch(language) or language in ("txt", "text"):
        raise UserError(f"cannot tell the language of {item}: name it LANG=PATH (e.g. "
                        f"en={item}) or give the file a language suffix (train.en)")
    return language, path


def open_parallel(spec: str) -> ParallelSource:
    """The parallel source `spec` names (module docstring), checked to exist and to name each
    language once; the files are read only when iterated."""
    items = [item.strip() for item in spec.split(",") if item.strip()]
    if len(items) == 1 and items[0].endswith(".tsv"):
        path = Path(items[0])
        if not path.is_file():
            raise UserError(f"parallel corpus {path} not found; check data.source")
        with _open_text(path) as handle:
            header = handle.readline().rstrip("\r\n").split("\t")
        languages = tuple(cell.strip() for cell in header)
        if len(languages) < 2 or not all(_LANGUAGE.fullmatch(lang) for lang in languages):
            raise UserError(f"the first line of {path} must name its languages, one per "
                            "tab-separated column (e.g. en<TAB>de)")
        files: tuple[Path, ...] = (path,)
    else:
        if len(items) < 2:
            raise UserError(f"a parallel corpus needs two or more line-aligned files, "
                            f"comma-separated (e.g. train.en,train.de), or a .tsv; got {spec!r}")
        pairs = [_language_of(item) for item in items]
        languages = tuple(language for language, _ in pairs)
        files = tuple(path for _, path in pairs)
        for path in files:
            if not path.is_file():
                raise UserError(f"parallel corpus file {path} not found; check data.source")
    repeated = sorted({lang for lang in languages if languages.count(lang) > 1})
    if repeated:
        raise UserError(f"the parallel corpus names {', '.join(repeated)} more than once; give "
                        "each language one file (or one TSV column)")
    return ParallelSource(languages, files)
