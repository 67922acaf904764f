"""Token classification data (named entities): CoNLL-style files and BERT's word-piece encoding.

File format (CoNLL-2003 `eng.train`, WNUT-17 `wnut17train.conll`): one token per line, its tag
in the last tab- or space-separated column (CoNLL-2003's middle POS/chunk columns are skipped),
a blank line between sentences, `-DOCSTART-` lines left out. Tags are BIO or BIOES
(`B-PER`, `I-PER`, `E-PER`, `S-PER`, `O`).

Encoding (Devlin et al. 2019 §5.3): each word is split into word pieces and only its first
piece carries the word's label (the others are ignored, `IGNORE`). A sentence whose pieces do
not fit `max_seq_length` is split into windows of `max_seq_length - specials` pieces that start
every `stride` pieces; every word is predicted from one window only: the one where it has the
most context on both sides (min of the pieces before and after it), as google-research/bert
run_squad.py `_check_is_max_context` picks a token's window, the first such window on ties.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.glue import SEG_ID_PAD, with_specials
from pretext_jax.input_pipeline.tokenizers import Tokenizer

IGNORE = -100  # the label of positions that are not a word's first piece (torch's ignore_index)
SPLITS = ("train", "dev", "test")
# File names a folder may hold for each split: plain ones, then WNUT-17's.
SPLIT_FILES = {
    "train": ("train.txt", "train.conll", "wnut17train.conll"),
    "dev": ("dev.txt", "dev.conll", "valid.txt", "emerging.dev.conll"),
    "test": ("test.txt", "test.conll", "emerging.test.annotated"),
}


@dataclass
class TaggedSentences:
    """Words and their tags, one list per sentence."""

    words: list[list[str]]
    tags: list[list[str]]


def split_file(data: str | Path, split: str) -> Path:
    """The file of `split` in the folder `data` (`SPLIT_FILES`), or `data` itself as
    `TRAIN[,DEV[,TEST]]` file names."""
    if split not in SPLITS:
        raise UserError(f"split {split!r} is unknown; use one of {', '.join(SPLITS)}")
    text = str(data)
    if "," in text or Path(text).is_file():
        files = text.split(",")
        index = SPLITS.index(split)
        if index >= len(files) or not files[index]:
            raise UserError(f"--data {text} names no {split} file; give TRAIN,DEV[,TEST]")
        path = Path(files[index])
        if not path.is_file():
            raise UserError(f"{split} file {path} not found")
        return path
    folder = Path(text)
    for name in SPLIT_FILES[split]:
        if (folder / name).is_file():
            return folder / name
    raise UserError(f"no {split} file in {folder} (looked for {', '.join(SPLIT_FILES[split])}); "
                    "pass --data FOLDER holding them, or --data TRAIN,DEV[,TEST] files")


def _check_tag(tag: str, where: str) -> None:
    if tag != "O" and (len(tag) < 3 or tag[0] not in "BIES" or tag[1] != "-"):
        raise UserError(f"{where}: tag {tag!r} is not O or B-/I-/E-/S-TYPE (BIO or BIOES); fix "
                        "the line (token, then its tag as the last column)")


def read_conll(path: str | Path) -> TaggedSentences:
    """The sentences of a CoNLL-style file: tokens from the first column, tags from the last."""
    path = Path(path)
    words: list[list[str]] = []
    tags: list[list[str]] = []
    sentence: tuple[list[str], list[str]] = ([], [])
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 ({e.reason} at byte {e.start}); re-encode it"
                        ) from None
    for number, line in enumerate([*lines, ""], start=1):
        columns = line.split()
        if not columns or columns[0] == "-DOCSTART-":
            if sentence[0]:
                words.append(sentence[0])
                tags.append(sentence[1])
                sentence = ([], [])
            continue
        where = f"{path} line {number}"
        if len(columns) < 2:
            raise UserError(f"{where} has a token and no tag; each line needs TOKEN TAG "
                            "(tab- or space-separated), blank lines between sentences")
        _check_tag(columns[-1], where)
        sentence[0].append(columns[0])
        sentence[1].append(columns[-1])
    if not words:
        raise UserError(f"{path} holds no tagged sentence; is it a CoNLL-style file?")
    return TaggedSentences(words, tags)


def label_set(sentences: TaggedSentences) -> tuple[str, ...]:
    """The tags of the training file: `O` first, then the others sorted."""
    found = {tag for sentence in sentences.tags for tag in sentence}
    return ("O", *sorted(found - {"O"}))


def _windows(length: int, span: int, stride: int) -> list[int]:
    """Start offsets of windows of `span` pieces every `stride` pieces covering `length`."""
    starts = [0]
    while starts[-1] + span < length:
        starts.append(starts[-1] + stride)
    return starts


def _best_window(position: int, starts: list[int], span: int, length: int) -> int:
    """The window in which `position` has most context on both sides (run_squad.py
    `_check_is_max_context`; the first on ties)."""
    def score(start: int) -> float:
        end = min(start + span, length) - 1
        if not start <= position <= end:
            return -1.0
        return min(position - start, end - position) + 0.01 * (end - start + 1)
    return max(range(len(starts)), key=lambda w: (score(starts[w]), -w))


def encode_tagged(sentences: TaggedSentences, labels: tuple[str, ...], tokenizer: Tokenizer,
                  max_seq_length: int, layout: str = "bert", stride: int = 0
                  ) -> dict[str, np.ndarray]:
    """Windows of word pieces with the layout's special tokens (`glue.with_specials`: BERT's
    `[CLS] A [SEP]`, RoBERTa's the same with its <s> and </s>, XLNet's left-padded
    `A <sep> <cls>`, XLM's `</s> A </s>`). Returns int32
    `input_ids`, `token_type_ids`, `attention_mask`, `labels` (the word's label id at its first
    piece in the window that predicts it, else `IGNORE`), `word` (that word's index in its
    sentence, else -1), each [N, max_seq_length], and `sentence` [N]. A tag outside `labels`
    (absent from the training file) is encoded as `O`'s id; the metrics read the gold tags
    from the file. A word that makes no piece is the tokenizer's unknown token. `stride` 0 =
    half the window."""
    span = max_seq_length - 2
    if span < 1:
        raise UserError(f"examples.max_seq_length={max_seq_length} leaves no room beside the 2 "
                        "special tokens; use at least 3 (BERT fine-tunes NER with 128)")
    stride = stride or max(1, span // 2)
    if not 0 < stride <= span:
        raise UserError(f"examples.stride={stride} must be in 1..{span} (max_seq_length - 2)")
    index = {tag: i for i, tag in enumerate(labels)}
    rows: dict[str, list] = {k: [] for k in ("input_ids", "token_type_ids", "attention_mask",
                                             "labels", "word", "sentence")}
    for number, (words, tags) in enumerate(zip(sentences.words, sentences.tags, strict=True)):
        pieces: list[int] = []
        firsts: list[int] = []
        for word in words:
            firsts.append(len(pieces))
            pieces.extend(tokenizer.encode(word) or [tokenizer.unk_id])
        starts = _windows(len(pieces), span, stride)
        owner = {first: _best_window(first, starts, span, len(pieces)) for first in firsts}
        for w, start in enumerate(starts):
            window = pieces[start:start + span]
            ids, types = with_specials(window, None, tokenizer, layout)
            offset = 0 if layout == "xlnet" else 1  # where the window's first piece sits
            labels_row = [IGNORE] * len(ids)
            word_row = [-1] * len(ids)
            for k, first in enumerate(firsts):
                if owner[first] == w:
                    labels_row[offset + first - start] = index.get(tags[k], 0)
                    word_row[offset + first - start] = k
            pad = max_seq_length - len(ids)
            left = layout == "xlnet"  # XLNet pads on the left
            for key, row, fill in (("input_ids", ids, tokenizer.pad_id),
                                   ("token_type_ids", types, SEG_ID_PAD if left else 0),
                                   ("attention_mask", [1] * len(ids), 0),
                                   ("labels", labels_row, IGNORE), ("word", word_row, -1)):
                rows[key].append([fill] * pad + row if left else row + [fill] * pad)
            rows["sentence"].append(number)
    return {k: np.asarray(v, np.int32) for k, v in rows.items()}
