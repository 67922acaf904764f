"""Tokenizers: WordPiece gives the same ids as HF's BERT tokenizers on the same vocab.txt;
sentencepiece training (specials, continuation flags, determinism); loading and errors."""

from __future__ import annotations

import collections
import re
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from conftest import shared_data_dir

from input_pipeline.errors import UserError
from input_pipeline.tokenizers import (
    SPECIALS,
    SentencePieceTokenizer,
    WordPieceTokenizer,
    _sample_sentences,
    load_tokenizer,
)

FALLBACK_LINES = [
    "The quick brown fox jumps over the lazy dog near the riverbank.",
    "Tokenizers split words, punctuation (like this!) and numbers such as 1,234.5.",
    "BERT's WordPiece vocabulary marks the continuation of a word with two hashes.",
    "Unaffable reviewers wrote unbelievably long reviews about the tokenization.",
    "She didn't know whether the e-mail had arrived; it was 3:45 p.m. on Tuesday.",
] * 20

TRICKY = [
    "", "   ", " \t\n\r ", "tabs\tand\nnewlines\r\nand  double  spaces",
    "Café Ünïcode naïve résumé Ångström", "中文字 mixed with English 漢字", "ΕΛΛΗΝΙΚΆ Ελληνικά",
    "control\x00chars\x07here\ufffd and\u200bzero\u200cwidth\x7f", "İstanbul ﬁne Kelvin \u212a",
    "punctuation!!!???...,,,;;--((]])$%^&`~@#", "¿Qué? ¡Sí! «quoted» „low“ — dash… …",
    "a" * 120, "unbelievably" * 9, "ＦＵＬＬ　ｗｉｄｔｈ　ｔｅｘｔ", "decomposed cafe\u0301",
    "line\u2028separator\u00a0nbsp",
    "Mr. O'Neil's e-mail: o.neil@example.com costs $3.50 (approx.) #hashtag",
]


def wikitext_lines(name: str, count: int) -> list[str]:
    """Non-heading lines of a WikiText-2 split, or the built-in lines without shared data."""
    path = shared_data_dir() / "wikitext-2" / name
    if not path.is_file():
        return FALLBACK_LINES
    lines = path.read_text(encoding="utf-8").splitlines()
    return [line for line in lines if line.strip() and not line.startswith(" = ")][:count]


def simple_words(text: str, lowercase: bool) -> list[str]:
    if lowercase:
        text = "".join(c for c in unicodedata.normalize("NFD", text.lower())
                       if unicodedata.category(c) != "Mn")
    return re.findall(r"\w+|[^\w\s]", text)


def write_vocab(path: Path, lines: list[str], lowercase: bool, size: int = 3000) -> Path:
    """A BERT-like vocab without training: specials, [unused0-9], every character seen (and its
    ## form), then the most frequent words, word starts and ##word endings of `lines`."""
    words = collections.Counter(w for line in lines for w in simple_words(line, lowercase))
    chars = sorted({c for w in words for c in w})
    subwords: collections.Counter[str] = collections.Counter()
    for word, n in words.items():
        subwords[word] += 3 * n
        for i in range(2, min(len(word), 6)):
            subwords[word[:i]] += n
            subwords["##" + word[-i:]] += n
    vocab = [*SPECIALS, *(f"[unused{i}]" for i in range(10)), *chars, *("##" + c for c in chars)]
    vocab += [w for w, _ in subwords.most_common(size)]
    path.write_text("\n".join(dict.fromkeys(vocab)) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def vocab_files(tmp_path_factory) -> dict[bool, Path]:
    lines = wikitext_lines("train.txt", 2000)
    folder = tmp_path_factory.mktemp("vocab")
    return {lowercase: write_vocab(folder / f"vocab_{lowercase}.txt", lines, lowercase)
            for lowercase in (True, False)}


@pytest.mark.parametrize("lowercase", [True, False], ids=["uncased", "cased"])
def test_wordpiece_equals_hf_bert_tokenizers(lowercase, vocab_files):
    legacy = pytest.importorskip("transformers.models.bert.tokenization_bert_legacy")
    transformers = pytest.importorskip("transformers")
    path = vocab_files[lowercase]
    ours = WordPieceTokenizer.from_vocab_file(path)
    assert ours.lowercase is lowercase  # inferred from the vocabulary
    slow = legacy.BertTokenizerLegacy(str(path), do_lower_case=lowercase)
    fast = transformers.BertTokenizer(str(path), do_lower_case=lowercase)
    texts = wikitext_lines("valid.txt", 500) + TRICKY
    if not lowercase:  # HF NFC-normalises first, google-research/bert does not
        texts = [t for t in texts if unicodedata.normalize("NFC", t) == t]
    pieces = unknown = 0
    for text in texts:
        ids = ours.encode(text)
        assert ids == slow.convert_tokens_to_ids(slow.tokenize(text)), text
        assert ids == fast.encode(text, add_special_tokens=False), text
        pieces += sum(ours.continuation[ids])
        unknown += ids.count(ours.unk_id)
    assert pieces > 100 and unknown > 3  # the texts exercise ## pieces and [UNK]


def test_wordpiece_details(vocab_files):
    tok = WordPieceTokenizer.from_vocab_file(vocab_files[True])
    assert [tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id] == [0, 1, 2, 3, 4]
    assert tok.special_ids == frozenset({0, 2, 3, 4})
    assert tok.continuation.shape == (tok.vocab_size,) and tok.continuation.dtype == bool
    assert not tok.continuation[list(range(5))].any()
    assert tok.encode("Thé ÉARLY,Wörld!") == tok.encode("the early , world !")
    assert [tok.id_to_token(i) for i in tok.encode("THE,(the)")] == ["the", ",", "(", "the", ")"]
    ids = tok.encode("unbelievablyzq")
    assert len(ids) > 1 and not tok.continuation[ids[0]] and tok.continuation[ids[1:]].all()
    assert tok.decode(ids) == "unbelievablyzq"
    assert tok.encode("a" * 100) != [tok.unk_id] and tok.encode("a" * 101) == [tok.unk_id]
    assert tok.encode("中") == [tok.unk_id] and tok.encode("") == []
    cased = WordPieceTokenizer.from_vocab_file(vocab_files[True], lowercase=False)
    assert not cased.lowercase and cased.encode("THE") != tok.encode("THE")


@pytest.mark.parametrize("content,message", [
    (b"", "is empty"),
    (b"\n \n", "is empty"),
    (b"[PAD]\n[UNK]\n[CLS]\n[SEP]\nhello\n", "has no [MASK]; use a BERT WordPiece vocab.txt"),
    (b"hello\nworld\n", "has no [PAD] [UNK] [CLS] [SEP] [MASK]"),
    (b"[PAD]\n\xff\xfe\n", "is not UTF-8 (bad byte at offset 6)"),
])
def test_bad_vocab_files(content, message, tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_bytes(content)
    with pytest.raises(UserError, match=re.escape(f"vocab file {path} {message}")):
        WordPieceTokenizer.from_vocab_file(path)


def test_missing_vocab_file(tmp_path):
    for path in (tmp_path / "missing.txt", tmp_path):
        with pytest.raises(UserError, match=f"vocab file {re.escape(str(path))} not found"):
            WordPieceTokenizer.from_vocab_file(path)


@pytest.fixture(scope="module")
def sentences() -> list[str]:
    from input_pipeline.sources import python_docs_documents

    return [s for doc in python_docs_documents() for s in doc][:2000]


@pytest.fixture(scope="module")
def sp_model(sentences, tmp_path_factory) -> SentencePieceTokenizer:
    prefix = tmp_path_factory.mktemp("sp") / "sp"
    return SentencePieceTokenizer.train(sentences, prefix, vocab_size=500)


def test_sentencepiece_training(sp_model, sentences, tmp_path):
    tok = sp_model
    assert tok.vocab_size == 500
    assert [tok.id_to_token(i) for i in range(5)] == list(SPECIALS)
    assert [tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id] == [0, 1, 2, 3, 4]
    assert tok.special_ids == frozenset({0, 2, 3, 4})
    for text in ["The object is returned by the function.", "Ünseen wörds, [MASK] & 42!"]:
        ids = tok.encode(text)
        assert ids and min(ids) >= 4 and not set(ids) & tok.special_ids
        if text.isascii():
            assert tok.decode(ids) == text
    pieces = [tok.id_to_token(i) for i in range(tok.vocab_size)]
    assert tok.continuation.dtype == bool and not tok.continuation[:5].any()
    assert all(tok.continuation[i] == (not p.startswith("▁")) for i, p in enumerate(pieces)
               if i >= 5)
    assert 0 < tok.continuation.sum() < tok.vocab_size - 5
    # Deterministic, and documents (lists of sentences) train the same model as sentences.
    documents = [sentences[i:i + 7] for i in range(0, len(sentences), 7)]
    again = SentencePieceTokenizer.train(documents, tmp_path / "again", vocab_size=500)
    assert [again.id_to_token(i) for i in range(500)] == pieces
    assert [again.processor.get_score(i) for i in range(500)] == [
        tok.processor.get_score(i) for i in range(500)]
    loaded = load_tokenizer(tok.model_file)
    assert isinstance(loaded, SentencePieceTokenizer) and loaded.encode("x y") == tok.encode(
        "x y")


def test_sentencepiece_errors(sentences, tmp_path):
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), vocab_size=300,
                                   model_prefix=str(tmp_path / "plain"), minloglevel=2)
    with pytest.raises(UserError, match=re.escape("has no [PAD] [CLS] [SEP] [MASK]; train")):
        SentencePieceTokenizer.load(tmp_path / "plain.model")
    with pytest.raises(UserError, match="vocab_size"):
        SentencePieceTokenizer.train(sentences[:20], tmp_path / "tiny", vocab_size=50000)
    with pytest.raises(UserError, match="model_type 'wordpiece' is unknown"):
        SentencePieceTokenizer.train(sentences, tmp_path / "x", 300, model_type="wordpiece")
    with pytest.raises(UserError, match="no text"):
        SentencePieceTokenizer.train(["", "  "], tmp_path / "x", 300)
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(UserError, match="is not a sentencepiece model"):
        SentencePieceTokenizer.load(tmp_path / "junk.model")
    with pytest.raises(UserError, match="not found"):
        SentencePieceTokenizer.load(tmp_path / "missing.model")


def test_sentence_sampling_is_seeded_and_ordered():
    texts = [f"sentence {i}" for i in range(1000)] + ["", " "]
    sample = _sample_sentences(texts, 100)
    assert len(sample) == 100 and sample == _sample_sentences(iter(texts), 100)
    numbers = [int(s.split()[1]) for s in sample]
    assert numbers == sorted(numbers) and numbers[-1] > 500  # spread over the whole corpus
    assert _sample_sentences([["a", ""], "b"], 10) == ["a", "b"]


def test_load_tokenizer_dispatch(vocab_files, sp_model, tmp_path):
    hf = tmp_path / "hf_bert"
    hf.mkdir()
    (hf / "vocab.txt").write_bytes(vocab_files[True].read_bytes())
    tok = load_tokenizer(hf)
    assert isinstance(tok, WordPieceTokenizer) and tok.lowercase  # inferred
    (hf / "tokenizer_config.json").write_text('{"do_lower_case": false}')
    assert not load_tokenizer(str(hf)).lowercase  # the config wins
    (hf / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(UserError, match="tokenizer_config.json is not a JSON object"):
        load_tokenizer(hf)
    assert isinstance(load_tokenizer(vocab_files[False]), WordPieceTokenizer)
    sp_dir = tmp_path / "sp_dir"
    sp_dir.mkdir()
    (sp_dir / "spiece.model").write_bytes(Path(sp_model.model_file).read_bytes())
    assert isinstance(load_tokenizer(sp_dir), SentencePieceTokenizer)
    with pytest.raises(UserError, match="not found"):
        load_tokenizer(tmp_path / "nothing")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(UserError, match="holds no vocab.txt"):
        load_tokenizer(tmp_path / "empty_dir")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(UserError, match="neither a sentencepiece .model nor"):
        load_tokenizer(tmp_path / "tokenizer.json")
    assert np.asarray(tok.continuation).sum() > 0
