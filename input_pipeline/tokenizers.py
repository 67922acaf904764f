"""Tokenizers: sentencepiece (train and load; also XLNet's released `spiece.model`), BERT
WordPiece from a released `vocab.txt`, and GPT-2's byte-level BPE from a `vocab.json` +
`merges.txt` folder (GPT-2, RoBERTa).

All expose the same small interface that example builders use (ids only): `vocab_size`,
`pad_id`, `unk_id`, `cls_id`, `sep_id`, `mask_id`, `eos_id` (the end-of-text token put between
documents by the causal LM; [SEP] where the vocabulary has no own one), `special_ids`,
`continuation` (a bool per id: the piece continues the previous word, for whole-word masking),
`encode`, `decode`, `id_to_token`, and `save(directory)`, which writes the files that
`load_tokenizer(directory)` reads back as the same tokenizer (a workdir's `tokenizer/`).
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import sys
import unicodedata
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import sentencepiece as spm

from pretext_jax.errors import UserError

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# A HF folder's tokenizer settings; `load_tokenizer` reads its `do_lower_case`.
TOKENIZER_CONFIG = "tokenizer_config.json"
SENTENCEPIECE_FILE = "spiece.model"


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    unk_id: int
    cls_id: int
    sep_id: int
    mask_id: int
    eos_id: int
    special_ids: frozenset[int]
    continuation: np.ndarray

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def id_to_token(self, index: int) -> str: ...

    def save(self, directory: Path) -> None: ...


def _write_lowercase(directory: Path, lowercase: bool) -> None:
    (directory / TOKENIZER_CONFIG).write_text(json.dumps({"do_lower_case": lowercase}) + "\n")


def _is_whitespace(char: str) -> bool:
    return char in " \t\n\r" or unicodedata.category(char) == "Zs"


def _is_control(char: str) -> bool:
    return char not in "\t\n\r" and unicodedata.category(char) in ("Cc", "Cf")


def _is_punctuation(char: str) -> bool:
    """ASCII non-alphanumeric symbols are punctuation too (tokenization.py `_is_punctuation`)."""
    cp = ord(char)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(char).startswith("P")


def _is_cjk(cp: int) -> bool:
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


class WordPieceTokenizer:
    """BERT's tokenizer (google-research/bert tokenization.py `FullTokenizer`): basic
    tokenisation (clean text, CJK split, optional lowercasing + accent stripping, punctuation
    split), then greedy longest-match-first WordPiece with `##` continuations."""

    max_input_chars_per_word = 100

    def __init__(self, vocab: list[str], lowercase: bool):
        self.tokens = vocab
        self.vocab = {token: i for i, token in enumerate(vocab)}
        self.lowercase = lowercase
        self.vocab_size = len(vocab)
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (
            self.vocab[t] for t in SPECIALS)
        self.eos_id = self.sep_id
        self.special_ids = frozenset((self.pad_id, self.cls_id, self.sep_id, self.mask_id))
        self.continuation = np.array([t.startswith("##") for t in vocab], bool)
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def from_vocab_file(cls, path: str | Path, lowercase: bool | None = None
                        ) -> WordPieceTokenizer:
        """Loads a `vocab.txt` (one token per line, id = line number). `lowercase=None` infers
        an uncased vocabulary when no token other than the bracketed specials has an ASCII
        uppercase letter (bert-base-uncased's holds `ℝ`, so any uppercase would read it as
        cased)."""
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
        missing = [s for s in SPECIALS if s not in vocab]
        if missing:
            raise UserError(f"vocab file {path} lacks {', '.join(missing)}; pass a BERT "
                            "WordPiece vocab.txt (it has [PAD] [UNK] [CLS] [SEP] [MASK])")
        if lowercase is None:  # ASCII only: uncased vocabularies keep symbols such as ℝ
            lowercase = not any("A" <= c <= "Z" for t in vocab
                                if not (t.startswith("[") and t.endswith("]")) for c in t)
        return cls(vocab, lowercase)

    def _basic_tokens(self, text: str) -> list[str]:
        chars = []
        for char in text:
            cp = ord(char)
            if cp == 0 or cp == 0xFFFD or _is_control(char):
                continue
            if _is_whitespace(char):
                chars.append(" ")
            elif _is_cjk(cp):
                chars.append(f" {char} ")
            else:
                chars.append(char)
        words = []
        for word in "".join(chars).split():
            if self.lowercase:
                word = "".join(c for c in unicodedata.normalize("NFD", word.lower())
                               if unicodedata.category(c) != "Mn")
            current = ""
            for char in word:
                if _is_punctuation(char):
                    if current:
                        words.append(current)
                    words.append(char)
                    current = ""
                else:
                    current += char
            if current:
                words.append(current)
        return words

    def _word_pieces(self, word: str) -> list[int]:
        if word in self._cache:
            return self._cache[word]
        if len(word) > self.max_input_chars_per_word:
            return [self.unk_id]
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
                pieces = [self.unk_id]
                break
            start = end
        self._cache[word] = pieces
        return pieces

    def encode(self, text: str) -> list[int]:
        return [i for word in self._basic_tokens(text) for i in self._word_pieces(word)]

    def id_to_token(self, index: int) -> str:
        return self.tokens[index]

    def decode(self, ids: Sequence[int]) -> str:
        text = " ".join(self.tokens[i] for i in ids)
        return text.replace(" ##", "")

    def save(self, directory: Path) -> None:
        """`vocab.txt` (one token a line) and `tokenizer_config.json` with `do_lower_case`."""
        (directory / "vocab.txt").write_text("".join(t + "\n" for t in self.tokens),
                                             encoding="utf-8")
        _write_lowercase(directory, self.lowercase)


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
              ) -> SentencePieceTokenizer:
        """Trains on an iterator of sentences; writes `<model_prefix>.model` and loads it.
        `sample_sentences` > 0 keeps a uniform random sample of that many sentences
        (sentencepiece's `input_sentence_size` reservoir, seeded by `seed`), so memory does not
        grow with the corpus. Deterministic for the same input (single-threaded)."""
        prefix = str(model_prefix)
        spm.set_random_generator_seed(seed)
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(sentences), model_prefix=prefix, vocab_size=vocab_size,
                model_type=model_type, pad_id=0, unk_id=1, bos_id=-1, eos_id=-1,
                pad_piece="[PAD]", unk_piece="[UNK]",
                control_symbols=["[CLS]", "[SEP]", "[MASK]"], character_coverage=0.9995,
                num_threads=1, shuffle_input_sentence=sample_sentences > 0,
                input_sentence_size=sample_sentences, minloglevel=2, hard_vocab_limit=True,
            )
        except RuntimeError as e:
            raise UserError(f"sentencepiece training failed ({str(e).splitlines()[0]}); lower "
                            "data.vocab_size or give more text") from None
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


def _category_class(major: str) -> str:
    """A regex character class body of every code point whose Unicode general category starts
    with `major` (`L` = \\p{L}, `N` = \\p{N}), as ranges."""
    ranges, start = [], None
    for cp in range(sys.maxunicode + 2):
        inside = cp <= sys.maxunicode and unicodedata.category(chr(cp)).startswith(major)
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            ranges.append(f"\\U{start:08x}-\\U{cp - 1:08x}" if cp - 1 > start
                          else f"\\U{start:08x}")
            start = None
    return "".join(ranges)


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
    letters, numbers, space = _category_class("L"), _category_class("N"), _WHITESPACE
    return re.compile(
        rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{letters}]+| ?[{numbers}]+| ?[^{space}{letters}{numbers}]+"
        rf"|[{space}]+(?![^{space}])|[{space}]+")


# Special tokens of the byte-level BPE vocabularies: GPT-2's one end-of-text token, RoBERTa's
# BERT-like set (fairseq's dictionary: <s>, <pad>, </s>, <unk>, then <mask> appended).
GPT2_EOT = "<|endoftext|>"
ROBERTA_SPECIALS = {"pad": "<pad>", "unk": "<unk>", "cls": "<s>", "sep": "</s>", "mask": "<mask>"}


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
        while len(parts) > 1:
            pairs = {(a, b) for a, b in zip(parts, parts[1:], strict=False)}
            best = min(pairs, key=lambda pair: self.ranks.get(pair, len(self.ranks)))
            if best not in self.ranks:
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
        ids = [self.vocab.get(part, self.unk_id) for part in parts]
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


def _sentencepiece(path: Path, lowercase: bool | None = None) -> SentencePieceTokenizer:
    """Ours (BERT's specials) or XLNet's (<cls>, <sep>, ...), by the pieces the model has. Only
    XLNet's text handling has a lowercasing step (prepro_utils.py `preprocess_text`)."""
    processor = spm.SentencePieceProcessor(model_file=str(path))
    if processor.id_to_piece(processor.piece_to_id("<cls>")) == "<cls>":
        return XLNetSentencePieceTokenizer(path, bool(lowercase))
    if lowercase:
        raise UserError(f"data.lowercase=true needs a WordPiece vocab.txt or XLNet's "
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
    """A sentencepiece `.model` (ours, or XLNet's `spiece.model`), a BERT `vocab.txt`, a
    byte-level BPE `vocab.json` (with `merges.txt` beside it), or a folder holding one of those.

    Casing (`lowercase`, WordPiece and XLNet only), first that applies: the argument
    (`data.lowercase`), a HF folder's `tokenizer_config.json` `do_lower_case`, the folder name
    (`casing_from_folder_name`), then for a vocab.txt whether it has ASCII capitals."""
    path = Path(spec)
    if not path.exists():
        raise UserError(f"tokenizer {path} not found; pass a sentencepiece .model, a BERT "
                        "vocab.txt or a HuggingFace BERT/XLNet/GPT-2/RoBERTa folder")
    folder = path if path.is_dir() else path.parent
    if lowercase is None and (folder / TOKENIZER_CONFIG).is_file():
        try:
            lowercase = json.loads((folder / TOKENIZER_CONFIG).read_text()).get("do_lower_case")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            raise UserError(f"{folder / TOKENIZER_CONFIG} is not a JSON object; fix or remove "
                            "it") from None
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
    if path.name == "vocab.json":
        if lowercase:
            raise UserError("data.lowercase=true does not apply to byte-level BPE (GPT-2, "
                            "RoBERTa encode text as it is); leave data.lowercase unset")
        return ByteLevelBPETokenizer.from_folder(path.parent)
    if path.suffix == ".model":
        try:
            return _sentencepiece(path, lowercase)
        except (RuntimeError, OSError):
            raise UserError(f"{path} is not a sentencepiece model; retrain it or pass a "
                            "vocab.txt") from None
    return WordPieceTokenizer.from_vocab_file(path, lowercase)
