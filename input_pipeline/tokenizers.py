"""Tokenizers: sentencepiece (train and load; also XLNet's released `spiece.model`), BERT
WordPiece from a released `vocab.txt`, GPT-2's byte-level BPE from a `vocab.json` +
`merges.txt` folder (GPT-2, RoBERTa), and XLM's Moses + fastBPE from an HF XLM folder.

All expose the same small interface that example builders use (ids only): `vocab_size`,
`pad_id`, `unk_id`, `cls_id`, `sep_id`, `mask_id`, `eos_id` (the end-of-text token put between
documents by the causal LM; [SEP] where the vocabulary has no own one), `special_ids`,
`continuation` (a bool per id: the piece continues the previous word: WordPiece `##x`,
sentencepiece and byte-level pieces without a leading space mark), `joins_next` (a bool per id:
the next piece continues this piece's word: fastBPE pieces without `</w>`; None where no piece
marks its word's end), which `word_starts`
combines for whole-word masking and word-level spans, `encode`, `decode`, `id_to_token`, and
`save(directory)`, which writes the files that `load_tokenizer(directory)` reads back as the
same tokenizer (a workdir's `tokenizer/`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import re
import shutil
import sys
import tempfile
import unicodedata
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import sentencepiece as spm

from pretext_jax.errors import UserError, require

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# A WordPiece vocabulary's specials other than the unknown token, by role: BERT's, and MPNet's
# (HF `MPNetTokenizer`: <s> opens a sequence, </s> separates and ends; microsoft/MPNet's
# vocab.txt adds them, <pad>, <unk> and <mask> to BERT's).
BERT_ROLES = {"pad": "[PAD]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
MPNET_ROLES = {"pad": "<pad>", "cls": "<s>", "sep": "</s>", "mask": "<mask>"}
# What those roles are for: a vocab.txt may lack them (encoding does not use them); a method
# that needs one is refused, naming it and this use.
ROLE_USES = {"pad": "to pad sequences", "cls": "to start a sequence",
             "sep": "to end segments and documents", "mask": "to mask tokens"}
SPECIAL_USES = {BERT_ROLES[role]: use for role, use in ROLE_USES.items()}
# ALBERT's spiece.model specials in SPECIALS' order (google-research/albert; HF
# `AlbertTokenizer`: pad <pad>, unk <unk>, cls [CLS], sep [SEP], mask [MASK]).
ALBERT_SPECIALS = ("<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]")
# A HF folder's tokenizer settings; `load_tokenizer` reads its `do_lower_case`.
TOKENIZER_CONFIG = "tokenizer_config.json"
SENTENCEPIECE_FILE = "spiece.model"


class Tokenizer(Protocol):
    """A WordPiece vocabulary may lack [PAD], [CLS], [SEP] or [MASK]: reading that id is then
    a UserError naming it (`WordPieceTokenizer.missing`)."""

    vocab_size: int
    pad_id: int
    unk_id: int
    cls_id: int
    sep_id: int
    mask_id: int
    eos_id: int
    special_ids: frozenset[int]
    continuation: np.ndarray
    joins_next: np.ndarray | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def id_to_token(self, index: int) -> str: ...

    def save(self, directory: Path) -> None: ...


def word_starts(ids: np.ndarray, continuation: np.ndarray,
                joins_next: np.ndarray | None = None) -> np.ndarray:
    """A bool per position of `ids`: the piece begins a word, being no continuation piece
    (`continuation`, a bool per id) after no piece that leaves its word open (`joins_next`, a
    bool per id; none: no vocabulary marks word ends)."""
    starts = ~continuation[ids]
    if joins_next is not None:
        starts[1:] &= ~joins_next[ids[:-1]]
    return starts


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """A digest of the files the tokenizer's `save` writes (vocabulary, merges or model, and
    settings such as the casing): what names a tokenizer object, which may have been trained
    in the cache, in a pre-training record cache's key (fine-tuning caches name
    `data.tokenizer` by `prepare.tokenizer_identity`)."""
    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save(Path(folder))
        for path in sorted(Path(folder).iterdir()):
            digest.update(path.name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


def _write_lowercase(directory: Path, lowercase: bool, **settings: object) -> None:
    (directory / TOKENIZER_CONFIG).write_text(
        json.dumps({"do_lower_case": lowercase, **settings}) + "\n")


def _specials_pattern(tokens: Iterable[str]) -> re.Pattern:
    """A regex that splits text at any of `tokens` (longest first), keeping them."""
    return re.compile("(" + "|".join(map(re.escape, sorted(tokens, key=len, reverse=True)))
                      + ")")


def _encode_around_specials(text: str, pattern: re.Pattern, encode: Callable[[str], list[int]],
                            special_id: Callable[[str], int]) -> list[int]:
    """HF's handling of special-token strings in text (tokenizers' added tokens, matched in the
    raw text before normalisation): each becomes its id, the text between is encoded on its
    own."""
    ids: list[int] = []
    for index, part in enumerate(pattern.split(text)):
        if index % 2:
            ids.append(special_id(part))
        elif part:
            ids += encode(part)
    return ids


def _is_punctuation(char: str) -> bool:
    """ASCII non-alphanumeric symbols are punctuation too (tokenization.py `_is_punctuation`)."""
    cp = ord(char)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(char).startswith("P")


# tokenization.py `_is_chinese_char`: the CJK Unified Ideographs blocks.
_CJK_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
               (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


@functools.cache
def _categories() -> np.ndarray:
    """The Unicode general category of every code point (the running Python's version), as
    two ASCII bytes per row: [major, minor] (e.g. "P", "d")."""
    names = "".join(map(unicodedata.category, map(chr, range(sys.maxunicode + 1))))
    return np.frombuffer(names.encode("ascii"), np.uint8).reshape(-1, 2)


def _is(major: str, minor: str = "") -> np.ndarray:
    """A flag per code point: its category starts with `major` (and then `minor`)."""
    categories = _categories()
    flags = categories[:, 0] == ord(major)
    return flags & (categories[:, 1] == ord(minor)) if minor else flags


@functools.cache
def _nonspacing_marks() -> dict[int, None]:
    """A `str.translate` table that drops every combining mark (category Mn): accent stripping
    after NFD (BERT's `_run_strip_accents`, XLM's lowercase_and_remove_accent.py)."""
    return dict.fromkeys(np.flatnonzero(_is("M", "n")).tolist())


def _runs(flags: np.ndarray) -> list[tuple[int, int]]:
    """The inclusive (first, last) code point ranges where `flags` (one per code point) holds."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], flags.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), (edges[1::2] - 1).tolist(), strict=True))


def _class_body(ranges: Iterable[tuple[int, int]]) -> str:
    """A regex character class body (no brackets) of inclusive code point ranges."""
    return "".join(f"\\U{a:08x}-\\U{b:08x}" if b > a else f"\\U{a:08x}" for a, b in ranges)


@dataclasses.dataclass(frozen=True)
class _BasicTokenizerTables:
    """tokenization.py `BasicTokenizer`'s character classes, as regexes and `str.translate`
    tables built once from `unicodedata` (the running Python's Unicode version)."""

    dropped: re.Pattern
    """`_clean_text`'s removals in the BMP: NUL, U+FFFD and `_is_control`'s characters: every
    category "C*" (control, format, surrogate, private use, unassigned) but tab, newline and
    carriage return (spaces)."""
    dropped_astral: re.Pattern
    """The same above U+FFFF (apart: `re` matches a BMP-only class by table, others by range)."""
    cjk: re.Pattern
    """`_tokenize_chinese_chars`' code points (`_is_chinese_char`), spaced out."""
    split: dict[int, str]
    """`_run_split_on_punc`: each punctuation character becomes a word of its own."""
    split_lower: dict[int, str | None]
    """`split`, and combining marks (Mn) removed (`_run_strip_accents`, after NFD)."""
    ascii_words: re.Pattern
    """All of `BasicTokenizer.tokenize` for printable ASCII text: letter and digit runs, and
    single punctuation characters."""
    ascii_words_lower: re.Pattern
    """`ascii_words` for lowercased text."""

    @classmethod
    @functools.cache
    def build(cls) -> _BasicTokenizerTables:
        dropped = _is("C")
        dropped[[9, 10, 13]] = False
        dropped[0xFFFD] = True
        punctuation = _is("P")
        punctuation[:128] = [_is_punctuation(chr(cp)) for cp in range(128)]
        split = {cp: f" {chr(cp)} " for cp in np.flatnonzero(punctuation).tolist()}
        ascii_punctuation = "".join(re.escape(chr(cp)) for cp in split if cp < 128)
        runs = _runs(dropped)
        bmp = [(first, min(last, 0xFFFF)) for first, last in runs if first <= 0xFFFF]
        astral = [(max(first, 0x10000), last) for first, last in runs if last > 0xFFFF]
        return cls(re.compile(f"[{_class_body(bmp)}]"), re.compile(f"[{_class_body(astral)}]"),
                   re.compile(f"[{_class_body(_CJK_RANGES)}]"), split, split | _nonspacing_marks(),
                   re.compile(f"[A-Za-z0-9]+|[{ascii_punctuation}]"),
                   re.compile(f"[a-z0-9]+|[{ascii_punctuation}]"))


class WordPieceTokenizer:
    """BERT's tokenizer (google-research/bert tokenization.py `FullTokenizer`): basic
    tokenisation (clean text, CJK split, optional lowercasing + accent stripping, punctuation
    split), then greedy longest-match-first WordPiece with `##` continuations.

    The basic tokenisation runs on whole strings (`_BasicTokenizerTables`: regexes,
    `str.translate`, `str.lower`, NFD) instead of character by character; its words are the
    reference's for every code point (tests/test_tokenizers.py checks them all), since the
    reference's per-word steps never cross the whitespace between words. Words map to ids
    through a bounded cache."""

    max_input_chars_per_word = 100
    cached_words = 1 << 18
    """Distinct words whose ids are kept; the cache starts again when full."""

    def __init__(self, vocab: list[str], lowercase: bool, source: str = "the vocabulary",
                 roles: Mapping[str, str] = BERT_ROLES, unk: str = "[UNK]"):
        self.tokens = vocab
        self.vocab = {token: i for i, token in enumerate(vocab)}
        self.lowercase = lowercase
        self.source = source
        self.roles, self.unk = dict(roles), unk
        self.vocab_size = len(vocab)
        self.unk_id = self.vocab[unk]
        self.missing = tuple(token for token in self.roles.values() if token not in self.vocab)
        self.special_ids = frozenset(self.vocab[t] for t in self.roles.values() if t in self.vocab)
        self.continuation = np.array([t.startswith("##") for t in vocab], bool)
        self.joins_next = None
        self._cache = _WordPieces(self._word_pieces)
        # MPNet's specials in text are those tokens (HF `MPNetTokenizer`); BERT's stay text
        self._specials = (None if self.roles == BERT_ROLES else _specials_pattern(
            [t for t in (*self.roles.values(), unk) if t in self.vocab]))

    def _special(self, role: str) -> int:
        token = self.roles[role]
        if token not in self.vocab:
            raise UserError(f"{self.source} lacks {', '.join(self.missing)}; this method needs "
                            f"{token} ({ROLE_USES[role]}): add it to the vocabulary (e.g. in "
                            "place of an [unused] line) or choose a method that does without")
        return self.vocab[token]

    @property
    def pad_id(self) -> int:
        return self._special("pad")

    @property
    def cls_id(self) -> int:
        return self._special("cls")

    @property
    def sep_id(self) -> int:
        return self._special("sep")

    @property
    def eos_id(self) -> int:
        """The end of a document for the causal LM: [SEP] (MPNet's </s>)."""
        return self._special("sep")

    @property
    def mask_id(self) -> int:
        return self._special("mask")

    @classmethod
    def from_vocab_file(cls, path: str | Path, lowercase: bool | None = None,
                        unk: str | None = None) -> WordPieceTokenizer:
        """Loads a `vocab.txt` (one token per line, id = line number). Only the unknown token
        is required, as in tokenization.py; the others are refused where a method asks for
        them (`ROLE_USES`). A vocabulary with <s>, </s>, <pad> and <mask> is MPNet's
        (`MPNET_ROLES`); its unknown token is `unk` (a HF folder's `unk_token`), else [UNK]
        where the vocabulary has it (microsoft/mpnet-base's, HF `MPNetTokenizer`'s default),
        else <unk>. `lowercase=None` infers an uncased vocabulary when no token other than the
        bracketed specials has an ASCII uppercase letter (bert-base-uncased's holds `ℝ`, so
        any uppercase would read it as cased)."""
        path = Path(path)
        if not path.is_file():
            raise UserError(f"vocab file {path} not found; pass a BERT vocab.txt or a "
                            "sentencepiece .model")
        try:
            vocab = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as e:
            raise UserError(f"vocab file {path} is not UTF-8 text (byte {e.start}); pass a "
                            "BERT WordPiece vocab.txt") from None
        vocab = [line.rstrip("\n") for line in vocab]
        while vocab and not vocab[-1].strip():
            vocab.pop()
        present = set(vocab)
        roles = MPNET_ROLES if set(MPNET_ROLES.values()) <= present else BERT_ROLES
        if unk not in present:
            unk = "[UNK]" if "[UNK]" in present or roles is BERT_ROLES else "<unk>"
        if unk not in present:  # WordPiece's id for a word it cannot spell
            raise UserError(f"vocab file {path} lacks {unk}; pass a BERT WordPiece vocab.txt "
                            "(it has [PAD] [UNK] [CLS] [SEP] [MASK]) or MPNet's")
        if lowercase is None:  # ASCII only: uncased vocabularies keep symbols such as ℝ
            lowercase = not any("A" <= c <= "Z" for t in vocab
                                if not (t.startswith("[") and t.endswith("]")) for c in t)
        return cls(vocab, lowercase, f"vocab file {path}", roles, unk)

    def basic_tokens(self, text: str) -> list[str]:
        """The words of `text`: tokenization.py `BasicTokenizer.tokenize`."""
        return self._basic_tokens(text)

    def word_pieces(self, word: str) -> tuple[int, ...]:
        """The ids of one basic token's WordPieces (`[UNK]` alone when it has no spelling)."""
        return self._cache[word]

    def _basic_tokens(self, text: str) -> list[str]:
        """tokenization.py `BasicTokenizer.tokenize`."""
        tables = _BasicTokenizerTables.build()
        if text.isascii() and text.isprintable():
            if self.lowercase:
                return tables.ascii_words_lower.findall(text.lower())
            return tables.ascii_words.findall(text)
        text = tables.dropped.sub("", text)
        if max(text, default="") > "\uffff":
            text = tables.dropped_astral.sub("", text)
        text = tables.cjk.sub(r" \g<0> ", text)
        if not self.lowercase:
            return text.translate(tables.split).split()
        return unicodedata.normalize("NFD", text.lower()).translate(tables.split_lower).split()

    def _word_pieces(self, word: str) -> tuple[int, ...]:
        """tokenization.py `WordpieceTokenizer.tokenize` of one word."""
        if len(word) > self.max_input_chars_per_word:
            return (self.unk_id,)
        pieces, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.vocab:
                    pieces.append(self.vocab[piece])
                    break
                end -= 1
            else:
                return (self.unk_id,)
            start = end
        return tuple(pieces)

    def encode(self, text: str) -> list[int]:
        if self._specials is not None:
            return _encode_around_specials(text, self._specials, self._encode_text,
                                           self.vocab.__getitem__)
        return self._encode_text(text)

    def _encode_text(self, text: str) -> list[int]:
        if len(self._cache) > self.cached_words:
            self._cache.clear()
        return list(itertools.chain.from_iterable(map(self._cache.__getitem__,
                                                      self._basic_tokens(text))))

    def id_to_token(self, index: int) -> str:
        return self.tokens[index]

    def decode(self, ids: Sequence[int]) -> str:
        text = " ".join(self.tokens[i] for i in ids)
        return text.replace(" ##", "")

    def save(self, directory: Path) -> None:
        """`vocab.txt` (one token a line) and `tokenizer_config.json` with `do_lower_case` and
        the unknown token."""
        (directory / "vocab.txt").write_text("".join(t + "\n" for t in self.tokens),
                                             encoding="utf-8")
        _write_lowercase(directory, self.lowercase, unk_token=self.unk)


class _WordPieces(dict):
    """word -> its ids (`pieces(word)`), computed on first use."""

    def __init__(self, pieces: Callable[[str], tuple[int, ...]]):
        super().__init__()
        self.pieces = pieces

    def __missing__(self, word: str) -> tuple[int, ...]:
        pieces = self[word] = self.pieces(word)
        return pieces


class SentencePieceTokenizer:
    """A sentencepiece model with BERT's specials at fixed ids: [PAD]=0, [UNK]=1, [CLS]=2,
    [SEP]=3, [MASK]=4 (bos/eos off). Pieces without a leading `▁` continue a word."""

    def __init__(self, model_file: str | Path):
        self.model_file = str(model_file)
        self.processor = spm.SentencePieceProcessor(model_file=self.model_file)
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = self._special_ids()
        self.eos_id = self.sep_id
        self.vocab_size = self.processor.get_piece_size()
        self.special_ids = frozenset((self.pad_id, self.cls_id, self.sep_id, self.mask_id))
        control = [self.processor.is_control(i) or self.processor.is_unknown(i)
                   for i in range(self.vocab_size)]
        self.continuation = np.array(
            [not (control[i] or self.processor.id_to_piece(i).startswith("▁"))
             for i in range(self.vocab_size)], bool)
        self.joins_next = None

    def _special_ids(self) -> list[int]:
        """The ids of [PAD], [UNK], [CLS], [SEP], [MASK] (in that order)."""
        ids = [self.processor.piece_to_id(s) for s in SPECIALS]
        if ids != list(range(len(SPECIALS))):
            raise UserError(f"sentencepiece model {self.model_file} does not have "
                            f"{', '.join(SPECIALS)} at ids 0-4; train it with "
                            "SentencePieceTokenizer.train (or leave data.tokenizer empty)")
        return ids

    @classmethod
    def train(cls, sentences: Iterable[str], model_prefix: str | Path, vocab_size: int,
              model_type: str = "unigram", sample_sentences: int = 0, seed: int = 0,
              max_sentence_bytes: int | None = None) -> SentencePieceTokenizer:
        """Trains on an iterator of sentences; writes `<model_prefix>.model` and loads it.
        `sample_sentences` > 0 keeps a uniform random sample of that many sentences
        (sentencepiece's `input_sentence_size` reservoir, seeded by `seed`), so memory does not
        grow with the corpus. Sentences longer than `max_sentence_bytes` UTF-8 bytes (None:
        sentencepiece's default) are skipped by sentencepiece; a failure names that, or text
        without visible characters, where it is the cause. Deterministic for the same input
        (single-threaded)."""
        prefix = str(model_prefix)
        text = _TrainingText(sentences, max_sentence_bytes or SENTENCEPIECE_MAX_SENTENCE_BYTES)
        spm.set_random_generator_seed(seed)
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(text), model_prefix=prefix, vocab_size=vocab_size,
                model_type=model_type, pad_id=0, unk_id=1, bos_id=-1, eos_id=-1,
                pad_piece="[PAD]", unk_piece="[UNK]",
                control_symbols=["[CLS]", "[SEP]", "[MASK]"], character_coverage=0.9995,
                num_threads=1, shuffle_input_sentence=sample_sentences > 0,
                input_sentence_size=sample_sentences, minloglevel=2, hard_vocab_limit=True,
                max_sentence_length=text.limit,
            )
        except RuntimeError as e:
            if text.interrupted:  # Ctrl-C while sentencepiece read the sentences
                raise KeyboardInterrupt from None
            raise UserError(text.failure(str(e).splitlines()[0])) from None
        return cls(prefix + ".model")

    def encode(self, text: str) -> list[int]:
        return self.processor.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.processor.decode([int(i) for i in ids])

    def id_to_token(self, index: int) -> str:
        return self.processor.id_to_piece(index)

    def save(self, directory: Path) -> None:
        """The model file as `spiece.model` (the name of HF's sentencepiece folders)."""
        shutil.copyfile(self.model_file, directory / SENTENCEPIECE_FILE)


# sentencepiece's `max_sentence_length`: longer training sentences are skipped without a word.
SENTENCEPIECE_MAX_SENTENCE_BYTES = 4192


class _TrainingText:
    """The sentences handed to sentencepiece's trainer, counted on the way: lines with visible
    text (a character that is neither a space nor of category C, the characters BERT's
    `_clean_text` drops), and how many of those are longer than `limit` bytes (which
    sentencepiece skips), for a failure's message."""

    def __init__(self, sentences: Iterable[str], limit: int):
        self.sentences, self.limit = sentences, limit
        self.lines = self.visible = self.too_long = self.longest = 0
        self.interrupted = False  # a KeyboardInterrupt stopped the reading
        tables = _BasicTokenizerTables.build()
        self._visible = re.compile(f"[^\\s{tables.dropped.pattern[1:-1]}]")

    def __iter__(self) -> Iterator[str]:
        try:
            yield from self._counted()
        except KeyboardInterrupt:  # sentencepiece reports it as a RuntimeError of its own
            self.interrupted = True
            raise

    def _counted(self) -> Iterator[str]:
        for sentence in self.sentences:
            self.lines += 1
            if self._visible.search(sentence):
                self.visible += 1
                size = len(sentence) if sentence.isascii() else len(sentence.encode("utf-8"))
                if size > self.limit:
                    self.too_long += 1
                    self.longest = max(self.longest, size)
            yield sentence

    def failure(self, error: str) -> str:
        """A one-line message for sentencepiece's `error`, naming the cause it can tell."""
        if not self.visible:
            return (f"the tokenizer cannot be trained: the corpus has no usable text (its "
                    f"{self.lines:,} lines hold only spaces and control characters such as NUL "
                    "bytes); give a text file")
        if self.too_long == self.visible:
            return (f"the tokenizer cannot be trained: every line with text is longer than "
                    f"{self.limit:,} bytes (the longest has {self.longest:,}), and sentencepiece "
                    "skips such lines; put one sentence or paragraph per line, or raise the limit "
                    f"with data.tokenizer_max_sentence_bytes={self.longest}")
        skipped = (f"; {self.too_long:,} of {self.visible:,} lines were longer than "
                   f"{self.limit:,} bytes and skipped (data.tokenizer_max_sentence_bytes raises "
                   "that)" if self.too_long else "")
        return (f"sentencepiece training failed ({error}); lower data.vocab_size or give more "
                f"text{skipped}")


# The specials of a released XLNet `spiece.model` in SPECIALS' order (zihangdai/xlnet
# data_utils.py `special_symbols`: <unk> 0, <s> 1, </s> 2, <cls> 3, <sep> 4, <pad> 5, <mask> 6,
# <eod> 7, <eop> 8).
XLNET_SPECIALS = ("<pad>", "<unk>", "<cls>", "<sep>", "<mask>")


class XLNetSentencePieceTokenizer(SentencePieceTokenizer):
    """XLNet's sentencepiece model (HF folders: `spiece.model`) with XLNet's text handling,
    zihangdai/xlnet prepro_utils.py: `preprocess_text` (whitespace runs become one space, ``
    and '' become ", accents are stripped (NFKD), lowercase when `lowercase`) then `encode_ids`
    (a piece that ends in a digit and a comma is split so the comma stands alone)."""

    def __init__(self, model_file: str | Path, lowercase: bool = False):
        self.lowercase = lowercase
        super().__init__(model_file)

    def _special_ids(self) -> list[int]:
        ids = [self.processor.piece_to_id(s) for s in XLNET_SPECIALS]
        if [self.processor.id_to_piece(i) for i in ids] != list(XLNET_SPECIALS):
            raise UserError(f"sentencepiece model {self.model_file} lacks one of "
                            f"{', '.join(XLNET_SPECIALS)}; pass XLNet's spiece.model")
        return ids

    def encode(self, text: str) -> list[int]:
        text = " ".join(text.strip().split()).replace("``", '"').replace("''", '"')
        text = "".join(c for c in unicodedata.normalize("NFKD", text)
                       if not unicodedata.combining(c))
        if self.lowercase:
            text = text.lower()
        pieces = []
        for piece in self.processor.encode(text, out_type=str):
            if len(piece) > 1 and piece[-1] == "," and piece[-2].isdigit():
                split = self.processor.encode(piece[:-1].replace("▁", ""), out_type=str)
                if piece[0] != "▁" and split[0][0] == "▁":
                    split = split[1:] if len(split[0]) == 1 else [split[0][1:], *split[1:]]
                pieces += [*split, piece[-1]]
            else:
                pieces.append(piece)
        return [self.processor.piece_to_id(piece) for piece in pieces]

    def save(self, directory: Path) -> None:
        """`spiece.model` and `tokenizer_config.json` with `do_lower_case`."""
        super().save(directory)
        _write_lowercase(directory, self.lowercase)


class AlbertSentencePieceTokenizer(SentencePieceTokenizer):
    """ALBERT's sentencepiece model (HF folders: `spiece.model`; specials `ALBERT_SPECIALS`)
    as HF `AlbertTokenizer` (what `AutoTokenizer` gives an ALBERT folder) encodes with it:
    special-token strings in the text are those tokens; the rest has `` and '' turned into ",
    accents stripped (NFKD, marks dropped) unless `keep_accents`, is lowercased when
    `lowercase`, normalised by the model's rule (its precompiled charsmap), split at
    whitespace, and each word, after a `▁`, is segmented by HF's unigram search (`_unigram`).
    google-research/albert tokenization.py also re-splits a piece that ends in a digit and a
    comma; HF's does not, nor does this."""

    cached_words = 1 << 18
    """Distinct words whose ids are kept; the cache starts again when full."""
    unknown_penalty = 10.0
    """The unknown token's score below the lowest piece score (sentencepiece `kUnkPenalty`)."""

    def __init__(self, model_file: str | Path, lowercase: bool = True,
                 keep_accents: bool = False):
        self.lowercase, self.keep_accents = lowercase, keep_accents
        super().__init__(model_file)
        self._specials = _specials_pattern(ALBERT_SPECIALS)
        self._normalizer = spm.SentencePieceNormalizer(
            model_file=self.model_file, add_dummy_prefix=False, escape_whitespaces=False,
            remove_extra_whitespaces=False)
        self._scores = {self.processor.id_to_piece(i): (i, self.processor.get_score(i))
                        for i in range(self.vocab_size)}
        self._longest = max(map(len, self._scores))
        self._unknown_score = min(score for _, score in self._scores.values()) - \
            self.unknown_penalty
        self._cache = _WordPieces(self._unigram)

    def _special_ids(self) -> list[int]:
        ids = [self.processor.piece_to_id(s) for s in ALBERT_SPECIALS]
        if [self.processor.id_to_piece(i) for i in ids] != list(ALBERT_SPECIALS):
            raise UserError(f"sentencepiece model {self.model_file} lacks one of "
                            f"{', '.join(ALBERT_SPECIALS)}; pass ALBERT's spiece.model")
        return ids

    def _unigram(self, word: str) -> tuple[int, ...]:
        """The best-scoring pieces of `word` (tokenizers' `Unigram::encode_optimized`, after
        sentencepiece's unigram_model.cc): a forward pass where a position keeps the first
        start with the strictly highest score (ties go to the earlier start, where
        sentencepiece's own search may differ), any vocabulary piece a candidate, a character
        no piece covers alone an unknown at `unknown_penalty` below the lowest score; runs of
        unknowns are one unknown id."""
        best: list[tuple[float, int, int] | None] = [(0.0, 0, -1)] + [None] * len(word)
        for start in range(len(word)):
            score_here = best[start][0]
            single = False
            for end in range(start + 1, min(len(word), start + self._longest) + 1):
                found = self._scores.get(word[start:end])
                if found is None:
                    continue
                single |= end == start + 1
                candidate = score_here + found[1]
                if best[end] is None or candidate > best[end][0]:
                    best[end] = (candidate, start, found[0])
            if not single:
                candidate = score_here + self._unknown_score
                if best[start + 1] is None or candidate > best[start + 1][0]:
                    best[start + 1] = (candidate, start, self.unk_id)
        ids, end = [], len(word)
        while end > 0:
            _, start, index = best[end]
            if not (index == self.unk_id and ids and ids[-1] == self.unk_id):
                ids.append(index)
            end = start
        return tuple(reversed(ids))

    def _encode_text(self, text: str) -> list[int]:
        text = text.replace("``", '"').replace("''", '"')
        if not self.keep_accents:
            text = "".join(c for c in unicodedata.normalize("NFKD", text)
                           if not unicodedata.category(c).startswith("M"))
        if self.lowercase:
            text = text.lower()
        if len(self._cache) > self.cached_words:
            self._cache.clear()
        return [i for word in self._normalizer.normalize(text).split()
                for i in self._cache["▁" + word]]

    def encode(self, text: str) -> list[int]:
        return _encode_around_specials(text, self._specials, self._encode_text,
                                       self.processor.piece_to_id)

    def save(self, directory: Path) -> None:
        """`spiece.model` and `tokenizer_config.json` with `do_lower_case` and
        `keep_accents`."""
        super().save(directory)
        _write_lowercase(directory, self.lowercase, keep_accents=self.keep_accents)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> character table (openai/gpt-2 encoder.py): the printable
    Latin-1 bytes stand for themselves, the other 68 (control bytes, space, ...) for U+0100
    onwards in byte order, so every token is a printable string without whitespace."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    table, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + shifted)
            shifted += 1
    return table


# `\s` of the `regex` module (Unicode White_Space): Python's `\s` minus U+001C-U+001F.
_WHITESPACE = ("\\t\\n\\x0b\\x0c\\r \\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f"
               "\\u205f\\u3000")


@functools.cache
def gpt2_pretokenizer() -> re.Pattern:
    """GPT-2's pre-tokenisation pattern (openai/gpt-2 encoder.py),
    `'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+`,
    written for the standard library's `re` (the `regex` package is not a dependency of
    pretext): the Unicode classes are spelled out from `unicodedata` (Python's Unicode
    version)."""
    letters, numbers = (_class_body(_runs(_is(major))) for major in "LN")
    space = _WHITESPACE
    return re.compile(
        rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{letters}]+| ?[{numbers}]+| ?[^{space}{letters}{numbers}]+"
        rf"|[{space}]+(?![^{space}])|[{space}]+")


# Special tokens of the byte-level BPE vocabularies: GPT-2's one end-of-text token, RoBERTa's
# BERT-like set (fairseq's dictionary: <s>, <pad>, </s>, <unk>, then <mask> appended).
GPT2_EOT = "<|endoftext|>"
ROBERTA_SPECIALS = {"pad": "<pad>", "unk": "<unk>", "cls": "<s>", "sep": "</s>", "mask": "<mask>"}


def merge_pairs(parts: list[str], ranks: Mapping[tuple[str, str], int]) -> list[str]:
    """BPE on one word's symbols: the lowest-ranked adjacent pair present is merged wherever it
    occurs (left to right), until no adjacent pair has a rank (openai/gpt-2 encoder.py `bpe`,
    fastBPE's `applybpe`)."""
    while len(parts) > 1:
        pairs = set(zip(parts, parts[1:], strict=False))
        best = min(pairs, key=lambda pair: ranks.get(pair, len(ranks)))
        if best not in ranks:
            break
        merged, i = [], 0
        while i < len(parts):
            if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                merged.append(parts[i] + parts[i + 1])
                i += 2
            else:
                merged.append(parts[i])
                i += 1
        parts = merged
    return parts


class ByteLevelBPETokenizer:
    """GPT-2's byte-level BPE (Radford et al. 2019 §2.2; openai/gpt-2 encoder.py), from a
    `vocab.json` (token -> id) and `merges.txt` (one merge `a b` per line, by rank) as HF GPT-2
    and RoBERTa folders hold them.

    Text is split at the vocabulary's special tokens (kept as single ids, as transformers
    does), each piece by GPT-2's pattern into words; a word's UTF-8 bytes become characters of
    `bytes_to_unicode`, which are merged pairwise, always the lowest-ranked pair present (all
    its occurrences, left to right), until no pair has a rank. Decoding maps the characters
    back to bytes (invalid UTF-8 becomes U+FFFD). RoBERTa's specials (<s>, </s>, <pad>, <unk>,
    <mask>) are used where present; GPT-2 has only <|endoftext|>, which then stands for all of
    them (as transformers' GPT2Tokenizer's bos/eos/unk)."""

    def __init__(self, vocab: dict[str, int], merges: list[tuple[str, str]]):
        self.vocab = vocab
        self.ranks = {pair: rank for rank, pair in enumerate(merges)}
        self.vocab_size = max(vocab.values()) + 1
        self.tokens = [""] * self.vocab_size
        for token, index in vocab.items():
            self.tokens[index] = token
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {char: byte for byte, char in self.byte_encoder.items()}
        specials = [t for t in (GPT2_EOT, *ROBERTA_SPECIALS.values()) if t in vocab]
        if not specials:
            raise UserError(f"vocab.json has neither {GPT2_EOT} nor RoBERTa's "
                            f"{' '.join(ROBERTA_SPECIALS.values())}; pass a GPT-2 or RoBERTa "
                            "tokenizer folder")
        fallback = vocab[GPT2_EOT] if GPT2_EOT in vocab else vocab["</s>"]
        ids = {role: vocab.get(token, fallback) for role, token in ROBERTA_SPECIALS.items()}
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (
            ids["pad"], ids["unk"], ids["cls"], ids["sep"], ids["mask"])
        self.eos_id = fallback
        self.special_ids = frozenset(vocab[t] for t in specials)
        self.continuation = np.array(
            [i not in self.special_ids and not t.startswith(self.byte_encoder[ord(" ")])
             for i, t in enumerate(self.tokens)], bool)
        self.joins_next = None
        self._specials = re.compile("(" + "|".join(
            re.escape(t) for t in sorted(specials, key=len, reverse=True)) + ")")
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def from_folder(cls, path: str | Path) -> ByteLevelBPETokenizer:
        """Loads `vocab.json` + `merges.txt` from a folder (HF GPT-2 / RoBERTa layout)."""
        path = Path(path)
        try:
            vocab = json.loads((path / "vocab.json").read_text(encoding="utf-8"))
            lines = (path / "merges.txt").read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"cannot read the byte-level BPE files in {path} ({e}); pass a "
                            "folder with GPT-2's vocab.json and merges.txt") from None
        merges = []
        for number, line in enumerate(lines, 1):
            if line.startswith("#version") or not line.strip():
                continue
            pair = line.split(" ")
            if len(pair) != 2:
                raise UserError(f"{path / 'merges.txt'} line {number} is not 'a b'; pass "
                                "GPT-2's merges.txt")
            merges.append((pair[0], pair[1]))
        if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
            raise UserError(f"{path / 'vocab.json'} is not a token -> id object; pass GPT-2's "
                            "vocab.json")
        return cls(vocab, merges)

    def _bpe(self, word: str) -> list[int]:
        if word in self._cache:
            return self._cache[word]
        parts = [self.byte_encoder[b] for b in word.encode("utf-8")]
        ids = [self.vocab.get(part, self.unk_id) for part in merge_pairs(parts, self.ranks)]
        self._cache[word] = ids
        return ids

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in self._specials.split(text):
            if piece in self.vocab and self.vocab[piece] in self.special_ids:
                ids.append(self.vocab[piece])
                continue
            for word in gpt2_pretokenizer().findall(piece):
                ids += self._bpe(word)
        return ids

    def save(self, directory: Path) -> None:
        """`vocab.json` and `merges.txt` (by rank, after GPT-2's `#version` line)."""
        (directory / "vocab.json").write_text(json.dumps(self.vocab, ensure_ascii=False),
                                              encoding="utf-8")
        merges = sorted(self.ranks, key=self.ranks.__getitem__)
        (directory / "merges.txt").write_text(
            "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")

    def decode(self, ids: Sequence[int]) -> str:
        text = "".join(self.tokens[int(i)] for i in ids)
        return bytes(self.byte_decoder.get(c, ord("?")) for c in text).decode(
            "utf-8", errors="replace")

    def id_to_token(self, index: int) -> str:
        return self.tokens[index]


# ------------------------------------------------------------------ XLM's Moses + fastBPE
# XLM's dictionary order (facebookresearch/XLM xlm/data/dictionary.py): <s> 0, </s> 1,
# <pad> 2, <unk> 3, then <special0> .. <special9>; XLM starts and ends a sentence with </s>
# (its `eos_index`) and masks with <special1> (HF `XLMTokenizer`'s mask token).
XLM_SPECIALS = {"pad": "<pad>", "unk": "<unk>", "cls": "</s>", "sep": "</s>",
                "mask": "<special1>"}
XLM_OTHER_SPECIALS = ("<s>", *(f"<special{i}>" for i in range(10)))
# Moses' replace-unicode-punctuation.perl: full-width and CJK punctuation to ASCII (the two
# full stops, which also eat the spaces after them, are the regexes).
_UNICODE_PUNCT = str.maketrans({
    "，": ",", "、": ",", "”": '"', "“": '"', "∶": ":", "：": ":", "？": "?", "《": '"',
    "》": '"', "）": ")", "！": "!", "（": "(", "；": ";", "」": '"', "「": '"', "～": "~",
    "’": "'", "…": "...", "━": "-", "〈": "<", "〉": ">", "【": "[", "】": "]", "％": "%",
    **{chr(0xFF10 + digit): str(digit) for digit in range(10)}})
_CJK_FULL_STOPS = re.compile(r"[。．]\s*")


@functools.cache
def _non_printing() -> re.Pattern:
    """Moses' remove-non-printing-char.perl: every code point of Unicode category C* (it
    becomes a space there; HF `XLMTokenizer` drops it instead)."""
    return re.compile(f"[{_class_body(_runs(_is('C')))}]")


# Sennrich's WMT16 Romanian normalisation and diacritic removal (XLM's en-ro model; HF
# `XLMTokenizer` applies it for lang=ro).
_ROMANIAN = str.maketrans("ŞşŢţȘșȚțĂăÂâÎî", "SsTtSsTtAaAaIi")
WORD_END = "</w>"


class MosesBPETokenizer:
    """XLM's text pipeline (Lample & Conneau 2019 §3.1; facebookresearch/XLM
    `tools/tokenize.sh`, `tools/lowercase_and_remove_accent.py`, fastBPE `applybpe`; HF
    `XLMTokenizer`) from an HF XLM folder's `vocab.json` + `merges.txt`: Moses'
    replace-unicode-punctuation, normalize-punctuation and remove-non-printing-char, then
    Moses' tokenizer without escaping (`sacremoses`, per `language`), optionally lowercasing
    and stripping accents (NFD, drop Mn), then BPE over each word's characters with `</w>`
    on the last (the lowest-ranked pair present merged everywhere, until none has a rank).

    Moses is language-dependent: `for_language(code)` gives the same vocabulary for another
    language (`encode` uses `language`). zh, th and ja need word segmenters XLM runs before
    BPE; they are refused. Special tokens in text become their ids (as transformers does).
    `lang2id` is the checkpoint's language table (its `config.json`) when known.
    fastBPE marks a word's last piece (`</w>`), not its continuations: `continuation` is False
    everywhere and `joins_next` holds for the pieces without the mark."""

    unsupported_languages = frozenset({"zh", "th", "ja"})
    cached_words = 1 << 18
    """Distinct words whose ids are kept; the cache starts again when full."""

    def __init__(self, vocab: dict[str, int], merges: list[tuple[str, str]], *,
                 lowercase: bool = True, language: str = "en",
                 lang2id: Mapping[str, int] | None = None):
        if language in self.unsupported_languages:
            raise UserError(f"XLM's tokenizer for {language!r} needs a word segmenter pretext "
                            "does not ship; segment the text beforehand or use another tokenizer")
        missing = sorted(set(XLM_SPECIALS.values()) - set(vocab))
        if missing:
            raise UserError(f"vocab.json lacks XLM's {' '.join(missing)}; pass an XLM "
                            "tokenizer folder (vocab.json + merges.txt)")
        self.vocab, self.merges = vocab, merges
        self.ranks = {pair: rank for rank, pair in enumerate(merges)}
        self.lowercase, self.language = lowercase, language
        self.lang2id = dict(lang2id) if lang2id else None
        self.vocab_size = max(vocab.values()) + 1
        self.tokens = [""] * self.vocab_size
        for token, index in vocab.items():
            self.tokens[index] = token
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (
            vocab[XLM_SPECIALS[role]] for role in ("pad", "unk", "cls", "sep", "mask"))
        self.eos_id = self.sep_id
        specials = [t for t in (*XLM_SPECIALS.values(), *XLM_OTHER_SPECIALS) if t in vocab]
        self.special_ids = frozenset(vocab[t] for t in specials)
        self.continuation = np.zeros(self.vocab_size, bool)
        self.joins_next = np.array([i not in self.special_ids and not t.endswith(WORD_END)
                                    for i, t in enumerate(self.tokens)], bool)
        self._specials = _specials_pattern(specials)
        moses = require("sacremoses", "xlm", "XLM's tokenizer (Moses)")
        self._normalizer = moses.MosesPunctNormalizer(lang=language)
        self._moses = moses.MosesTokenizer(lang=language)
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def from_folder(cls, path: str | Path, lowercase: bool | None = None,
                    language: str = "en") -> MosesBPETokenizer:
        """An HF XLM folder: `vocab.json`, `merges.txt` (`a b count` lines, by rank), the
        casing from `tokenizer_config.json`'s `do_lowercase_and_remove_accent` (XLM's default:
        true) unless `lowercase` is given, `lang2id` from it or `config.json`."""
        path = Path(path)
        try:
            vocab = json.loads((path / "vocab.json").read_text(encoding="utf-8"))
            lines = (path / "merges.txt").read_text(encoding="utf-8").splitlines()
            settings = {}
            for name in ("config.json", TOKENIZER_CONFIG):
                if (path / name).is_file():
                    settings.update(json.loads((path / name).read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"cannot read XLM's tokenizer files in {path} ({e}); pass a folder "
                            "with XLM's vocab.json and merges.txt") from None
        if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
            raise UserError(f"{path / 'vocab.json'} is not a token -> id object; pass XLM's "
                            "vocab.json")
        merges = [tuple(line.split()[:2]) for line in lines if line.strip()]
        if any(len(pair) != 2 for pair in merges):
            raise UserError(f"{path / 'merges.txt'} has a line that is not 'a b [count]'; pass "
                            "XLM's merges.txt")
        if lowercase is None:
            lowercase = bool(settings.get("do_lowercase_and_remove_accent", True))
        lang2id = settings.get("lang2id")
        return cls(vocab, merges, lowercase=lowercase, language=language,
                   lang2id=lang2id if isinstance(lang2id, dict) else None)

    def for_language(self, language: str) -> MosesBPETokenizer:
        """The same vocabulary, merges and casing with Moses' rules for `language`."""
        if language == self.language:
            return self
        return MosesBPETokenizer(self.vocab, self.merges, lowercase=self.lowercase,
                                 language=language, lang2id=self.lang2id)

    def words(self, text: str) -> list[str]:
        """Moses' words of `text` after XLM's normalisation (and lowercasing)."""
        text = _CJK_FULL_STOPS.sub(". ", text).translate(_UNICODE_PUNCT)
        text = _non_printing().sub(" ", self._normalizer.normalize(text))
        if self.language == "ro":
            text = text.translate(_ROMANIAN)
        words = self._moses.tokenize(text, return_str=False, escape=False)
        if self.lowercase:
            text = unicodedata.normalize("NFD", " ".join(words).lower())
            words = text.translate(_nonspacing_marks()).lower().split(" ")
        return [word for word in words if word]

    def _bpe(self, word: str) -> list[int]:
        if word in self._cache:
            return self._cache[word]
        if len(self._cache) > self.cached_words:
            self._cache.clear()
        parts = [*word[:-1], word[-1] + WORD_END]
        ids = [self.vocab.get(part, self.unk_id) for part in merge_pairs(parts, self.ranks)]
        self._cache[word] = ids
        return ids

    def _encode_text(self, text: str) -> list[int]:
        return [i for word in self.words(text) for i in self._bpe(word)]

    def encode(self, text: str) -> list[int]:
        return _encode_around_specials(text, self._specials, self._encode_text,
                                       self.vocab.__getitem__)

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.tokens[int(i)] for i in ids).replace(WORD_END, " ").strip()

    def id_to_token(self, index: int) -> str:
        return self.tokens[index]

    def save(self, directory: Path) -> None:
        """`vocab.json`, `merges.txt` and a `tokenizer_config.json` that names XLM's tokenizer,
        its casing and the language table."""
        (directory / "vocab.json").write_text(json.dumps(self.vocab, ensure_ascii=False),
                                              encoding="utf-8")
        (directory / "merges.txt").write_text("".join(f"{a} {b}\n" for a, b in self.merges),
                                              encoding="utf-8")
        (directory / TOKENIZER_CONFIG).write_text(json.dumps(self.settings(), ensure_ascii=False))

    def settings(self) -> dict[str, object]:
        """The `tokenizer_config.json` entries of HF `XLMTokenizer` that this one sets."""
        settings: dict[str, object] = {"tokenizer_class": "XLMTokenizer",
                                       "do_lowercase_and_remove_accent": self.lowercase}
        if self.lang2id:
            settings["lang2id"] = self.lang2id
            settings["id2lang"] = {str(i): lang for lang, i in self.lang2id.items()}
        return settings


def is_xlm_folder(folder: Path) -> bool:
    """An HF XLM tokenizer folder: its config names XLM's tokenizer, or its merges mark word
    ends with `</w>` (fastBPE) where GPT-2's byte-level BPE has none."""
    try:
        settings = json.loads((folder / TOKENIZER_CONFIG).read_text(encoding="utf-8"))
        if isinstance(settings, dict) and settings.get("tokenizer_class") == "XLMTokenizer":
            return True
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        pass
    try:
        with open(folder / "merges.txt", encoding="utf-8") as merges:
            return any(WORD_END in line for line in itertools.islice(merges, 200))
    except (OSError, UnicodeDecodeError):
        return False


def for_language(tokenizer: Tokenizer, language: str) -> Tokenizer:
    """The tokenizer for text of `language`: a language-dependent one's (XLM's Moses rules,
    `MosesBPETokenizer.for_language`), else the tokenizer itself."""
    bound = getattr(tokenizer, "for_language", None)
    return tokenizer if bound is None else bound(language)


def language_encoder(tokenizer: Tokenizer, language: str) -> Callable[[str], list[int]]:
    """`encode` for text of `language` (`for_language`)."""
    return for_language(tokenizer, language).encode


def _sentencepiece(path: Path, lowercase: bool | None = None, keep_accents: bool = False
                   ) -> SentencePieceTokenizer:
    """Ours (BERT's specials), XLNet's (<cls>, <sep>, ...) or ALBERT's (<pad>, <unk>, [CLS],
    ...), by the pieces the model has. XLNet's and ALBERT's text handling lowercase (XLNet's
    by default not, ALBERT's by default, as HF's tokenizers)."""
    processor = spm.SentencePieceProcessor(model_file=str(path))

    def has(piece: str) -> bool:
        return processor.id_to_piece(processor.piece_to_id(piece)) == piece

    if has("<cls>"):
        return XLNetSentencePieceTokenizer(path, bool(lowercase))
    if all(map(has, ALBERT_SPECIALS)):
        return AlbertSentencePieceTokenizer(path, lowercase is not False, keep_accents)
    if lowercase:
        raise UserError(f"data.lowercase=true needs a WordPiece vocab.txt, XLNet's or ALBERT's "
                        f"spiece.model; {path.name} encodes text as it is (leave data.lowercase "
                        "unset)")
    return SentencePieceTokenizer(path)


def casing_from_folder_name(path: Path) -> bool | None:
    """The casing a released model's folder name states: Google's `uncased_L-12_H-768_A-12`,
    `wwm_cased_L-24_H-1024_A-16`, HF's `bert-base-uncased` (None when the name says neither)."""
    words = set(re.split(r"[-_.]", path.name.lower()))
    if "uncased" in words:
        return True
    if "cased" in words:
        return False
    return None


def load_tokenizer(spec: str | Path, lowercase: bool | None = None
                   ) -> WordPieceTokenizer | SentencePieceTokenizer | ByteLevelBPETokenizer:
    """A sentencepiece `.model` (ours, or XLNet's or ALBERT's `spiece.model`), a BERT (or
    MPNet) `vocab.txt`, a byte-level BPE `vocab.json` (with `merges.txt` beside it), XLM's
    `vocab.json` + `merges.txt` (`is_xlm_folder`; its casing: the argument, else its
    `do_lowercase_and_remove_accent`), or a folder holding one of those. A HF folder's
    `tokenizer_config.json` also gives ALBERT's `keep_accents` and a vocab.txt's `unk_token`.

    Casing (`lowercase`, WordPiece, XLNet and ALBERT only), first that applies: the argument
    (`data.lowercase`), a HF folder's `tokenizer_config.json` `do_lower_case`, the folder name
    (`casing_from_folder_name`), then for a vocab.txt whether it has ASCII capitals."""
    path = Path(spec)
    requested_lowercase = lowercase
    if not path.exists():
        raise UserError(f"tokenizer {path} not found; pass a sentencepiece .model, a BERT "
                        "vocab.txt or a HuggingFace BERT/ALBERT/MPNet/XLNet/GPT-2/RoBERTa/XLM "
                        "folder")
    folder = path if path.is_dir() else path.parent
    settings = {}
    if (folder / TOKENIZER_CONFIG).is_file():
        try:
            settings = json.loads((folder / TOKENIZER_CONFIG).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            settings = None
        if not isinstance(settings, dict):
            raise UserError(f"{folder / TOKENIZER_CONFIG} is not a JSON object; fix or remove "
                            "it")
    if lowercase is None:
        lowercase = settings.get("do_lower_case")
    if lowercase is None:
        lowercase = casing_from_folder_name(folder)
    if path.is_dir():
        if (path / "vocab.txt").is_file():
            path = path / "vocab.txt"
        elif (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            path = path / "vocab.json"
        elif len(models := sorted(path.glob("*.model"))) == 1:
            path = models[0]
        else:
            raise UserError(f"{path} holds no vocab.txt, vocab.json + merges.txt or single "
                            "sentencepiece .model; point data.tokenizer at the file or folder")
    if path.name == "vocab.json" and is_xlm_folder(path.parent):
        return MosesBPETokenizer.from_folder(path.parent, requested_lowercase)
    if path.name == "vocab.json":
        if lowercase:
            raise UserError("data.lowercase=true does not apply to byte-level BPE (GPT-2, "
                            "RoBERTa encode text as it is); leave data.lowercase unset")
        return ByteLevelBPETokenizer.from_folder(path.parent)
    if path.suffix == ".model":
        try:
            return _sentencepiece(path, lowercase, bool(settings.get("keep_accents", False)))
        except (RuntimeError, OSError):
            raise UserError(f"{path} is not a sentencepiece model; retrain it or pass a "
                            "vocab.txt") from None
    unk = settings.get("unk_token")
    return WordPieceTokenizer.from_vocab_file(path, lowercase, unk if isinstance(unk, str)
                                              else None)
