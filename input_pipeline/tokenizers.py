"""Tokenizers: BERT WordPiece from a released `vocab.txt`, and sentencepiece (train or load).

Example builders see only ids, through the small `Tokenizer` interface below: the five BERT
specials, `special_ids` (never masked, never drawn as random replacement words) and
`continuation` (per id: the piece continues the previous word, for whole-word masking).
"""

from __future__ import annotations

import json
import random
import unicodedata
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import sentencepiece as spm

from input_pipeline.errors import UserError

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
SENTENCEPIECE_MODEL_TYPES = ("unigram", "bpe", "char", "word")


class Tokenizer(Protocol):
    """What example builders need from a tokenizer; `encode` never adds specials."""

    vocab_size: int
    pad_id: int
    unk_id: int
    cls_id: int
    sep_id: int
    mask_id: int
    special_ids: frozenset[int]
    continuation: np.ndarray

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def id_to_token(self, i: int) -> str: ...


# CJK Unified Ideographs blocks (and compatibility ideographs), as in BERT's BasicTokenizer.
_CJK_RANGES = (
    (0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F),
)


def _is_cjk(cp: int) -> bool:
    return any(lo <= cp <= hi for lo, hi in _CJK_RANGES)


def _is_punctuation(char: str) -> bool:
    """Unicode P* categories plus every ASCII symbol that is not a letter, digit or space
    (google-research/bert tokenization.py, `_is_punctuation`)."""
    if char.isascii():
        return char.isprintable() and not char.isalnum() and char != " "
    return unicodedata.category(char).startswith("P")


class _CleanTable(dict):
    """A `str.translate` table, filled per code point on first use, that performs BERT's
    `_clean_text` (drop NUL, U+FFFD and Cc/Cf controls other than tab/newline/CR; whitespace to
    a space) and `_tokenize_chinese_chars` (spaces around CJK ideographs)."""

    def __missing__(self, cp: int) -> str:
        char = chr(cp)
        category = unicodedata.category(char)
        if cp in (0, 0xFFFD) or (char not in "\t\n\r" and category in ("Cc", "Cf")):
            out = ""
        elif char in " \t\n\r" or category == "Zs":
            out = " "
        elif _is_cjk(cp):
            out = f" {char} "
        else:
            out = char
        self[cp] = out
        return out


_CLEAN = _CleanTable()
_CACHE_LIMIT = 1 << 20  # words whose ids are memoised; beyond this, words are re-tokenised


class WordPieceTokenizer:
    """BERT's `FullTokenizer` (google-research/bert tokenization.py): `BasicTokenizer` (clean
    text, split CJK ideographs, lowercase and strip accents when uncased, split punctuation),
    then greedy longest-match-first WordPiece with `##` continuations; words longer than
    `max_input_chars_per_word` become [UNK] (100, as in HF's port; the current google master
    uses 200)."""

    max_input_chars_per_word = 100

    def __init__(self, vocab: Sequence[str], lowercase: bool):
        self.tokens = list(vocab)
        self.vocab = {token: i for i, token in enumerate(self.tokens)}
        self.lowercase = lowercase
        self.vocab_size = len(self.tokens)
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (
            self.vocab[s] for s in SPECIALS)
        self.special_ids = frozenset((self.pad_id, self.cls_id, self.sep_id, self.mask_id))
        self.continuation = np.array([t.startswith("##") for t in self.tokens], bool)
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def from_vocab_file(cls, path: str | Path, lowercase: bool | None = None
                        ) -> WordPieceTokenizer:
        """Loads a released BERT `vocab.txt`: one token per line, id = line number.

        `lowercase=None` infers the casing: the vocab is uncased when no token other than the
        bracketed ones (`[CLS]`, `[unused0]`, ...) contains an ASCII capital letter.
        """
        path = Path(path)
        if not path.is_file():
            raise UserError(f"vocab file {path} not found; pass a BERT WordPiece vocab.txt, a "
                            "HuggingFace BERT folder or a sentencepiece .model")
        data = path.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"vocab file {path} is not UTF-8 (bad byte at offset {e.start}); "
                            "pass a BERT WordPiece vocab.txt") from None
        lines = text.split("\n")
        while lines and not lines[-1].strip():
            lines.pop()
        if not lines:
            raise UserError(f"vocab file {path} is empty; pass a BERT WordPiece vocab.txt")
        vocab = [line.strip() for line in lines]
        missing = [s for s in SPECIALS if s not in vocab]
        if missing:
            raise UserError(f"vocab file {path} has no {' '.join(missing)}; use a BERT "
                            "WordPiece vocab.txt or train a sentencepiece model with `pretext` "
                            "defaults")
        if lowercase is None:
            lowercase = not any(
                "A" <= c <= "Z" for t in vocab if not (t.startswith("[") and t.endswith("]"))
                for c in t)
        return cls(vocab, lowercase)

    def _word_ids(self, word: str) -> list[int]:
        """Ids of one whitespace-delimited word of cleaned text (lowercasing, accent
        stripping, punctuation split, then WordPiece)."""
        if self.lowercase:
            word = word.lower()
            if not word.isascii():
                word = "".join(c for c in unicodedata.normalize("NFD", word)
                               if unicodedata.category(c) != "Mn")
        pieces, current = [], []
        for char in word:
            if _is_punctuation(char):
                pieces.append("".join(current))
                pieces.append(char)
                current = []
            else:
                current.append(char)
        pieces.append("".join(current))
        return [i for piece in pieces for token in piece.split() for i in self._wordpiece(token)]

    def _wordpiece(self, token: str) -> list[int]:
        if len(token) > self.max_input_chars_per_word:
            return [self.unk_id]
        ids, start = [], 0
        while start < len(token):
            for end in range(len(token), start, -1):
                piece = token[start:end] if start == 0 else "##" + token[start:end]
                index = self.vocab.get(piece)
                if index is not None:
                    ids.append(index)
                    start = end
                    break
            else:
                return [self.unk_id]
        return ids

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without [CLS]/[SEP]."""
        ids: list[int] = []
        cache = self._cache
        for word in text.translate(_CLEAN).split():
            word_ids = cache.get(word)
            if word_ids is None:
                word_ids = self._word_ids(word)
                if len(cache) < _CACHE_LIMIT:
                    cache[word] = word_ids
            ids.extend(word_ids)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Tokens joined by spaces, with `##` continuations glued to their word."""
        return " ".join(self.tokens[int(i)] for i in ids).replace(" ##", "")

    def id_to_token(self, i: int) -> str:
        return self.tokens[int(i)]


class SentencePieceTokenizer:
    """A sentencepiece model holding BERT's specials. Models trained by `train` have [PAD]=0,
    [UNK]=1, [CLS]=2, [SEP]=3, [MASK]=4 and no bos/eos; a loaded model needs a pad piece and
    [CLS], [SEP], [MASK] pieces. Pieces not starting with `▁` continue the previous word."""

    def __init__(self, processor: spm.SentencePieceProcessor, model_file: str | Path):
        self.processor = processor
        self.model_file = str(model_file)
        self.vocab_size = processor.get_piece_size()
        self.pad_id, self.unk_id = processor.pad_id(), processor.unk_id()
        self.cls_id, self.sep_id, self.mask_id = (processor.piece_to_id(s) for s in SPECIALS[2:])
        missing = [] if self.pad_id >= 0 else [SPECIALS[0]]
        missing += [s for s in SPECIALS[2:] if processor.id_to_piece(processor.piece_to_id(s)) != s]
        if missing:
            raise UserError(f"sentencepiece model {model_file} has no {' '.join(missing)}; "
                            "train one with `pretext` defaults (leave data.tokenizer empty) "
                            "or pass a BERT WordPiece vocab.txt")
        controls = {i for i in range(self.vocab_size) if processor.is_control(i)}
        self.special_ids = frozenset(
            {self.pad_id, self.cls_id, self.sep_id, self.mask_id} | controls)
        self.continuation = np.array(
            [not (i in self.special_ids or i == self.unk_id
                  or processor.id_to_piece(i).startswith("▁"))
             for i in range(self.vocab_size)], bool)

    @classmethod
    def load(cls, model_file: str | Path) -> SentencePieceTokenizer:
        """Loads a `.model` file written by sentencepiece."""
        path = Path(model_file)
        if not path.is_file():
            raise UserError(f"sentencepiece model {path} not found; check data.tokenizer or "
                            "leave it empty to train one")
        try:
            processor = spm.SentencePieceProcessor(model_file=str(path))
        except (RuntimeError, OSError):
            raise UserError(f"{path} is not a sentencepiece model; retrain it (leave "
                            "data.tokenizer empty) or pass a BERT vocab.txt") from None
        return cls(processor, path)

    @classmethod
    def train(cls, texts: Iterable[str | Sequence[str]], model_prefix: str | Path,
              vocab_size: int, model_type: str = "unigram", *,
              max_sentences: int = 2_000_000) -> SentencePieceTokenizer:
        """Trains on sentences (an iterable of strings, or of documents that are lists of
        strings), writes `<model_prefix>.model` and loads it.

        Deterministic for the same input on any machine: the thread count is fixed (the pieces
        depend on it), sentencepiece's own sampling is off, and corpora above `max_sentences`
        are reservoir-sampled here with a fixed seed.
        """
        if model_type not in SENTENCEPIECE_MODEL_TYPES:
            raise UserError(f"sentencepiece model_type {model_type!r} is unknown; use one of "
                            f"{', '.join(SENTENCEPIECE_MODEL_TYPES)}")
        if vocab_size <= len(SPECIALS):
            raise UserError(f"vocab_size={vocab_size} leaves no room beside the "
                            f"{len(SPECIALS)} specials; use e.g. data.vocab_size=8000")
        sentences = _sample_sentences(texts, max_sentences)
        if not sentences:
            raise UserError("no text to train the sentencepiece model on; give a corpus with "
                            "non-blank sentences")
        prefix = Path(model_prefix)
        prefix.parent.mkdir(parents=True, exist_ok=True)
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(sentences), model_prefix=str(prefix),
                vocab_size=vocab_size, model_type=model_type,
                pad_id=0, unk_id=1, bos_id=-1, eos_id=-1, pad_piece=SPECIALS[0],
                unk_piece=SPECIALS[1], control_symbols=list(SPECIALS[2:]), byte_fallback=False,
                num_threads=16, shuffle_input_sentence=False, input_sentence_size=0,
                minloglevel=2,
            )
        except RuntimeError as e:
            raise UserError(f"sentencepiece training failed ({str(e).splitlines()[0]}); lower "
                            "data.vocab_size or give more text") from None
        return cls.load(f"{prefix}.model")

    def encode(self, text: str) -> list[int]:
        """Piece ids of `text`, without specials."""
        return self.processor.encode(text, out_type=int)

    def decode(self, ids: Sequence[int]) -> str:
        return self.processor.decode([int(i) for i in ids])

    def id_to_token(self, i: int) -> str:
        return self.processor.id_to_piece(int(i))


def _sample_sentences(texts: Iterable[str | Sequence[str]], limit: int) -> list[str]:
    """Non-blank sentences, flattened from documents; a seeded reservoir sample of `limit` of
    them (in corpus order) when there are more."""
    rng = random.Random(0)
    kept: list[tuple[int, str]] = []
    seen = 0
    for item in texts:
        for sentence in [item] if isinstance(item, str) else item:
            if not sentence.strip():
                continue
            if len(kept) < limit:
                kept.append((seen, sentence))
            else:
                slot = rng.randrange(seen + 1)
                if slot < limit:
                    kept[slot] = (seen, sentence)
            seen += 1
    return [sentence for _, sentence in sorted(kept)]


def load_tokenizer(spec: str | Path) -> WordPieceTokenizer | SentencePieceTokenizer:
    """A sentencepiece `.model`; a WordPiece `.txt` vocab (e.g. BERT's `vocab.txt`); or a folder
    holding `vocab.txt` (a HuggingFace BERT folder: `do_lower_case` in its
    `tokenizer_config.json` decides the casing, else it is inferred) or a single `.model`."""
    path = Path(spec)
    if path.is_dir():
        vocab = path / "vocab.txt"
        if vocab.is_file():
            return WordPieceTokenizer.from_vocab_file(vocab, _hf_lowercase(path))
        models = sorted(path.glob("*.model"))
        if len(models) == 1:
            return SentencePieceTokenizer.load(models[0])
        raise UserError(f"folder {path} holds no vocab.txt and no single sentencepiece "
                        ".model; point data.tokenizer at the file")
    if not path.is_file():
        raise UserError(f"tokenizer {path} not found; pass a sentencepiece .model, a BERT "
                        "vocab.txt or a HuggingFace BERT folder")
    if path.suffix == ".model":
        return SentencePieceTokenizer.load(path)
    if path.suffix == ".txt":
        return WordPieceTokenizer.from_vocab_file(path)
    raise UserError(f"tokenizer {path} is neither a sentencepiece .model nor a WordPiece "
                    "vocab .txt; pass one of those or a HuggingFace BERT folder")


def _hf_lowercase(folder: Path) -> bool | None:
    """`do_lower_case` from a HuggingFace `tokenizer_config.json`, or None when absent."""
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        value = json.loads(config.read_text(encoding="utf-8")).get("do_lower_case")
    except (ValueError, AttributeError):
        raise UserError(f"{config} is not a JSON object; fix or delete it (casing is then "
                        "inferred from vocab.txt)") from None
    return None if value is None else bool(value)
