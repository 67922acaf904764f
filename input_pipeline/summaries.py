"""Document-summary pairs for abstractive summarisation (`run.py finetune --task summarize`),
their records, and the sentence split that ROUGE-Lsum and the lead-3 baseline read.

`--data` is a folder holding, for each split (`train`; `dev`, also named `val`, `valid` or
`validation`; optionally `test`), either

- two line-aligned files, `SPLIT.source` and `SPLIT.target` (fairseq's and BART's
  `train.source` / `train.target`; `SPLIT.src` / `SPLIT.tgt` as MASS and ProphetNet name them):
  line i of the target is the summary of line i of the source; or
- one tab-separated file `SPLIT.tsv`, `document<TAB>summary` on every line (no header).

Both files of a split are checked before anything is read into records: an empty file, files of
different lengths (both counts named), a TSV line without a tab or with more than one (its line
number named) is a one-line error. A pair with an empty side is left out (as translation's).

Records (as translation's, `examples.translation.padded`): the document's tokens and EOS in
`inputs` (cut to `max_source_length`, EOS included; `--truncate-source` in BART's recipe), the
summary's and EOS in `targets` (cut to `max_target_length`), both padded with the tokenizer's
pad id, and one language id on every position (`language_ids`, for models with language
embeddings).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import numpy as np

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.descriptions import files_fingerprint
from pretext_jax.input_pipeline.examples.translation import padded
from pretext_jax.input_pipeline.tokenizers import Tokenizer

SPLIT_NAMES = {"train": ("train",), "dev": ("dev", "val", "valid", "validation"),
               "test": ("test",)}
SUFFIXES = (("source", "target"), ("src", "tgt"))

# A sentence ends at ., ! or ? (closing quotes or brackets may follow) before whitespace.
_SENTENCE_END = re.compile(r"([.!?][\"')\]]*)\s+")


@dataclasses.dataclass(frozen=True)
class SummaryFiles:
    """One split's files: (source, target) line-aligned, or one TSV."""

    files: tuple[Path, ...]

    @property
    def is_tsv(self) -> bool:
        return len(self.files) == 1

    def fingerprint(self) -> str:
        """Changes when a file is edited or renamed."""
        return files_fingerprint(Path("/"), [p.resolve() for p in self.files],
                                 [""] * len(self.files))


def split_files(folder: str | Path, split: str) -> SummaryFiles:
    """The files of `split` in the folder `folder` (module docstring)."""
    root = Path(folder)
    if not root.is_dir():
        raise UserError(f"--data {folder} is not a folder; give a folder with train.source and "
                        "train.target (or train.tsv) and the same for dev")
    looked = []
    for name in SPLIT_NAMES[split]:
        for source, target in SUFFIXES:
            pair = (root / f"{name}.{source}", root / f"{name}.{target}")
            looked.append(f"{pair[0].name} + {pair[1].name}")
            if pair[0].is_file() or pair[1].is_file():
                have, lack = pair if pair[0].is_file() else pair[::-1]
                if not lack.is_file():
                    raise UserError(f"{root} has {have.name} but no {lack.name}; give both "
                                    "files of the split")
                return SummaryFiles(pair)
        looked.append(f"{name}.tsv")
        if (root / f"{name}.tsv").is_file():
            return SummaryFiles((root / f"{name}.tsv",))
    raise UserError(f"no {split} files in {root} (looked for {', '.join(looked)}); give "
                    "line-aligned SPLIT.source and SPLIT.target files or a SPLIT.tsv of "
                    "document<TAB>summary lines")


def _open(path: Path) -> TextIO:
    return open(path, encoding="utf-8")  # noqa: SIM115 (closed by the caller)


def _lines(path: Path) -> Iterator[str]:
    """The lines of `path` without their line ends; bytes that are not UTF-8 are a UserError."""
    with _open(path) as handle:
        try:
            for line in handle:
                yield line.rstrip("\r\n")
        except UnicodeDecodeError as e:
            raise UserError(f"{path} is not UTF-8 (byte {e.object[e.start]:#04x}); re-encode it, "
                            f"e.g. iconv -f latin1 -t utf-8 {path.name}") from None


def check_files(files: SummaryFiles) -> int:
    """The number of lines of the split, after refusing an empty file, line-aligned files of
    different lengths and TSV lines with no or several tabs (one-line UserErrors)."""
    counts = []
    for path in files.files:
        count = 0
        for number, line in enumerate(_lines(path), start=1):
            count = number
            if files.is_tsv and line.count("\t") != 1:
                tabs = line.count("\t")
                found = f"{tabs + 1} tab-separated columns" if tabs else "no tab"
                raise UserError(f"{path} line {number:,} has {found}; each line must be "
                                "document<TAB>summary")
        if count == 0:
            raise UserError(f"{path} is empty; give it the split's "
                            f"{'document<TAB>summary lines' if files.is_tsv else 'lines'}")
        counts.append(count)
    if len(set(counts)) > 1:
        (source, target), (n_source, n_target) = files.files, counts
        raise UserError(f"{source.name} has {n_source:,} lines but {target.name} has "
                        f"{n_target:,}; line i of the target must be the summary of line i of "
                        "the source")
    return counts[0]


def read_pairs(files: SummaryFiles) -> Iterator[tuple[str, str]]:
    """(document, summary) of every line whose two sides are not empty (whitespace at the ends
    stripped), in order; `check_files` first."""
    check_files(files)
    if files.is_tsv:
        rows = (line.split("\t") for line in _lines(files.files[0]))
    else:
        rows = zip(_lines(files.files[0]), _lines(files.files[1]), strict=True)
    for document, summary in rows:
        document, summary = document.strip(), summary.strip()
        if document and summary:
            yield document, summary


def sentences(text: str) -> list[str]:
    """The sentences of `text`: split after ., ! or ? (and closing quotes or brackets) before
    whitespace, and at line breaks. A rule, not a trained splitter (the papers' lead-3 and
    ROUGE-Lsum used NLTK's or Stanford CoreNLP's): abbreviations such as "U.S. officials" split
    too."""
    return [part.strip() for line in text.splitlines()
            for part in _SENTENCE_END.sub("\\1\n", line).split("\n") if part.strip()]


def lead(text: str, count: int = 3) -> str:
    """The first `count` sentences of `text` (the lead-3 baseline's summary, See et al. 2017)."""
    return " ".join(sentences(text)[:count])


def summary_record(document_ids: list[int], summary_ids: list[int], language: int,
                   max_source_length: int, max_target_length: int, eos_id: int, pad_id: int
                   ) -> dict[str, np.ndarray]:
    """The record of one pair (module docstring)."""
    inputs, input_mask = padded(document_ids, max_source_length, eos_id, pad_id)
    targets, target_mask = padded(summary_ids, max_target_length, eos_id, pad_id)
    return {"inputs": inputs, "input_mask": input_mask, "targets": targets,
            "target_mask": target_mask,
            "source_language_ids": np.full(max_source_length, language, np.int32),
            "target_language_ids": np.full(max_target_length, language, np.int32)}


def encoded_pairs(files: SummaryFiles, tokenizer: Tokenizer, prefix: str = ""
                  ) -> Iterator[tuple[str, str, list[int], list[int]]]:
    """(document, summary, document ids, summary ids) of every pair whose two sides have
    tokens; `prefix` is put before every document (T5's "summarize: ")."""
    for document, summary in read_pairs(files):
        document_ids, summary_ids = tokenizer.encode(prefix + document), tokenizer.encode(summary)
        if document_ids and summary_ids:
            yield document, summary, document_ids, summary_ids
