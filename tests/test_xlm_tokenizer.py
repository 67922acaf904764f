"""XLM's tokenizer (`MosesBPETokenizer`): ids equal to HF `XLMTokenizer` on the same
vocab.json + merges.txt for English, German and French text (Multi30K's when present), cased
and lowercased; Moses' remove-non-printing-char spaces where HF drops; loading, saving and the
HF export; refusals."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from text_utils import write_xlm_tokenizer

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.tokenizers import (
    ByteLevelBPETokenizer,
    MosesBPETokenizer,
    is_xlm_folder,
    language_encoder,
    load_tokenizer,
)
from pretext_jax.pretrain import hf_tokenizer

pytest.importorskip("sacremoses")

LANGUAGES = ("de", "en", "fr")
FALLBACK = {
    "en": ["A man in an orange hat starring at something.",
           "Two young, White males are outside near many bushes.",
           "Mr. Smith's dog can't swim; it's 3.5 km away (approx.) - isn't it?"],
    "de": ["Ein Mann mit einem orangefarbenen Hut, der etwas anstarrt.",
           "Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche.",
           "Das ist z.B. schön, oder? Straße, Größe, Übermaß: 1.000,50 €."],
    "fr": ["Un homme avec un chapeau orange regardant quelque chose.",
           "Deux jeunes hommes blancs sont dehors près de buissons.",
           "L'été, c'est à côté de l'hôtel : « très » élevé ; n'est-ce pas ?"],
}
# Moses' and XLM's normalisation: full-width and CJK punctuation, curly quotes, ellipses, dashes,
# accents, digits, runs of spaces, and XLM's special tokens inside text.
TRICKY = ["“Quoted” ‘text’… — and – dashes", "ＦＵＬＬ　ｗｉｄｔｈ１２３！？", "end。 next．ok",
          "Café naïve résumé ÉCOLE", "a  b   c", "", "1,234.5 dollars & 50% of 7/8 < 9 > 2",
          "l'homme d'affaires", "Ǆemal İstanbul ß"]
WITH_SPECIALS = ["x</s>y <special1> z <unk>", "<s>", "a <pad>b"]


def multi30k_lines(language: str, shared: Path | None, count: int, start: int = 0) -> list[str]:
    path = shared / "multi30k" / f"train.{language}" if shared else None
    if path and path.is_file():
        with open(path, encoding="utf-8") as lines:
            return [line.rstrip("\n") for line in itertools.islice(lines, start, start + count)]
    return FALLBACK[language]


@pytest.fixture(scope="module")
def xlm_folders(tmp_path_factory) -> dict[str, Path]:
    """Two HF XLM folders (lowercased and cased) on one BPE learned from the three languages'
    text: XLM's dictionary order (<s> </s> <pad> <unk> <special0..9>), every character with
    and without `</w>`, the merged symbols; a config.json with XLM-15's language table."""
    from conftest import shared_data_dir

    shared = shared_data_dir() if shared_data_dir().is_dir() else None
    text = [line for lang in LANGUAGES for line in multi30k_lines(lang, shared, 2000)]
    text += TRICKY
    root = tmp_path_factory.mktemp("xlm_tokenizers")
    xnli15 = ("ar", "bg", "de", "el", "en", "es", "fr", "hi", "ru", "sw", "th", "tr", "ur",
              "vi", "zh")
    return {name: write_xlm_tokenizer(root / name, text, lower, 400,
                                      {lang: i for i, lang in enumerate(xnli15)})
            for name, lower in (("lowercased", True), ("cased", False))}


def hf_ids(hf, text: str, language: str) -> list[int]:
    """HF's ids of `text` in `language`: `tokenize` splits out the special tokens but passes no
    language on (transformers 5: English Moses), so other languages call `_tokenize`."""
    tokens = hf.tokenize(text) if language == "en" else hf._tokenize(text, lang=language)
    return hf.convert_tokens_to_ids(tokens)


@pytest.mark.parametrize("name", ["lowercased", "cased"])
def test_ids_equal_hf_xlm_tokenizer(xlm_folders, name):
    """Multi30K's held-back lines (not those the BPE learned on) and the tricky texts in each
    language: the same ids as `XLMTokenizer(...).tokenize(text, lang=...)`."""
    transformers = pytest.importorskip("transformers")
    from conftest import shared_data_dir

    shared = shared_data_dir() if shared_data_dir().is_dir() else None
    folder = xlm_folders[name]
    hf = transformers.XLMTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"),
                                   do_lowercase_and_remove_accent=name == "lowercased")
    ours = load_tokenizer(folder)
    assert isinstance(ours, MosesBPETokenizer) and ours.lowercase is (name == "lowercased")
    assert [ours.pad_id, ours.unk_id, ours.cls_id, ours.sep_id, ours.mask_id] == [
        hf.pad_token_id, hf.unk_token_id, hf.cls_token_id, hf.sep_token_id, hf.mask_token_id]
    compared = 0
    for language in LANGUAGES:
        encode = language_encoder(ours, language)
        texts = multi30k_lines(language, shared, 300, start=2000) + TRICKY
        texts += WITH_SPECIALS if language == "en" else []
        mismatches = [t for t in texts if encode(t) != hf_ids(hf, t, language)]
        assert not mismatches, (language, mismatches[:3])
        compared += len(texts)
        unknown = sum(i == ours.unk_id for t in texts for i in encode(t))
        assert unknown < 0.01 * sum(len(encode(t)) for t in texts)  # real pieces, not <unk>s
    assert compared >= (900 if shared else 40)
    # Controls: the casing and the language's Moses rules each change some ids.
    other = load_tokenizer(xlm_folders["cased" if name == "lowercased" else "lowercased"])
    assert any(other.encode(t) != ours.encode(t) for t in FALLBACK["en"])
    assert ours.for_language("en").encode("l'homme") != ours.for_language("fr").encode("l'homme")


def test_non_printing_characters_become_spaces_as_moses_does(xlm_folders):
    """remove-non-printing-char.perl replaces each category-C character by a space (HF
    `XLMTokenizer` drops it, joining the words around it); the one known departure."""
    transformers = pytest.importorskip("transformers")
    folder = xlm_folders["lowercased"]
    hf = transformers.XLMTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"))
    ours = load_tokenizer(folder)
    assert ours.words("two\u200bwords\ttab") == ["two", "words", "tab"]
    assert hf.tokenize("two\u200bwords") == hf.tokenize("twowords")


def test_loading_saving_and_hf_export(xlm_folders, tmp_path):
    """An XLM folder is XLM's tokenizer, not GPT-2's byte-level BPE (its merges mark word ends);
    its language table comes from config.json; `save` and the HF export read back as the same
    tokenizer (the export as `XLMTokenizer`, sentences framed by </s> as XLM's own code)."""
    transformers = pytest.importorskip("transformers")
    folder = xlm_folders["lowercased"]
    assert is_xlm_folder(folder)
    ours = load_tokenizer(folder / "vocab.json")
    assert isinstance(ours, MosesBPETokenizer)
    assert ours.lang2id["en"] == 4 and ours.lang2id["de"] == 2
    texts = FALLBACK["en"] + TRICKY
    assert ours.decode(ours.encode(FALLBACK["en"][0])) == " ".join(ours.words(FALLBACK["en"][0]))
    saved = tmp_path / "saved"
    saved.mkdir()
    ours.save(saved)
    back = load_tokenizer(saved)
    assert isinstance(back, MosesBPETokenizer) and back.lang2id == ours.lang2id
    assert all(back.encode(t) == ours.encode(t) for t in texts)
    exported = tmp_path / "exported"
    exported.mkdir()
    hf_tokenizer.save(ours, exported, "xlm", ours.vocab_size)
    auto = transformers.AutoTokenizer.from_pretrained(str(exported))
    assert type(auto).__name__ == "XLMTokenizer"
    for text in texts[:4]:
        assert auto(text)["input_ids"] == [ours.cls_id, *ours.encode(text), ours.sep_id]
    # Control: read as byte-level BPE (what an XLM folder gave before), the ids are others.
    gpt2_view = ByteLevelBPETokenizer.__new__(ByteLevelBPETokenizer)
    assert not isinstance(gpt2_view, MosesBPETokenizer)
    bare = tmp_path / "gpt2"
    bare.mkdir()
    vocab = json.loads((folder / "vocab.json").read_text())
    (bare / "vocab.json").write_text(json.dumps({**vocab, "<mask>": len(vocab)}))
    (bare / "merges.txt").write_text("#version: 0.2\nt h\n")
    assert isinstance(load_tokenizer(bare), ByteLevelBPETokenizer)


def test_whole_words_are_moses_words(xlm_folders):
    """fastBPE marks a word's last piece (`</w>`), so where a word begins depends on the piece
    before: whole-word masking groups, MPNet's / XLNet's / BART's word starts (all through
    `word_starts`) give one group per Moses word of Multi30K text (lines with no <unk>);
    without `joins_next` the groups would be single pieces (the control)."""
    from conftest import shared_data_dir

    from pretext_jax.input_pipeline.examples import bert as bert_examples
    from pretext_jax.input_pipeline.examples.seq2seq import Seq2SeqVocab

    shared = shared_data_dir() if shared_data_dir().is_dir() else None
    ours = load_tokenizer(xlm_folders["cased"])
    vocab = bert_examples.MaskingVocab.from_tokenizer(ours)
    split_pieces = 0
    for language in LANGUAGES:
        tokenizer = ours.for_language(language)
        for text in multi30k_lines(language, shared, 100, start=2000) + FALLBACK[language]:
            ids = np.asarray(tokenizer.encode(text))
            if ours.unk_id in ids:  # an unknown piece loses its `</w>`: its word splits there
                continue
            framed = np.concatenate([[vocab.cls_id], ids, [vocab.sep_id]])
            groups = bert_examples.masking_candidates(framed, vocab, whole_word_mask=True)
            words = ["".join(ours.id_to_token(framed[p]) for p in group).removesuffix("</w>")
                     for group in groups]
            assert words == tokenizer.words(text), (language, text)
            starts = vocab.word_starts(ids)
            assert starts.tolist() == Seq2SeqVocab.from_tokenizer(ours, 0).word_starts(
                ids).tolist()
            split_pieces += len(ids) - int(starts.sum())
    assert split_pieces > 100  # many words are several pieces, so the check has teeth
    piecewise = dataclasses.replace(vocab, joins_next=None)
    assert piecewise.word_starts(ids).all() and not vocab.word_starts(ids).all()


def test_fine_tuning_records_are_cached_per_language(xlm_folders, tmp_path):
    """A task's records read with another `data.language` (another Moses: French splits
    "l'homme" as "l' homme", English as "l 'homme") are written anew, not read from the first
    language's cache; without a language the key is the one caches had before it existed."""
    from text_utils import write_glue_folder

    from pretext_jax.input_pipeline.prepare import (
        DataConfig,
        source_fingerprint,
        tokenizer_identity,
    )
    from pretext_jax.objectives.common.glue_data import GlueExampleConfig, prepare_glue

    (tmp_path / "glue").mkdir()
    glue = write_glue_folder(tmp_path / "glue", ["good", "bad", "l'homme", "d'affaires", "chat"],
                             (8, 4), (4, 4))
    prepared = {}
    for language in ("en", "fr"):
        data = DataConfig(source=glue, tokenizer=str(xlm_folders["lowercased"]),
                          language=language)
        prepared[language] = prepare_glue(data, GlueExampleConfig(max_seq_length=32),
                                          tmp_path / "cache", 0).train
    assert prepared["en"].directory != prepared["fr"].directory
    ids = [p.examples(range(len(p)))["input_ids"] for p in prepared.values()]
    assert not np.array_equal(*ids)
    plain = DataConfig(source=glue, tokenizer=str(xlm_folders["lowercased"]))
    assert tokenizer_identity(plain) == [source_fingerprint(plain.tokenizer), plain.lowercase]


def test_refusals(xlm_folders, tmp_path, monkeypatch):
    ours = load_tokenizer(xlm_folders["lowercased"])
    with pytest.raises(UserError, match="word segmenter"):
        ours.for_language("zh")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "vocab.json").write_text(json.dumps({"a</w>": 0, "<pad>": 1}))
    (broken / "merges.txt").write_text("a b</w> 3\n")
    with pytest.raises(UserError, match="lacks XLM's"):
        load_tokenizer(broken)
    (broken / "merges.txt").write_text("a\n")
    (broken / "tokenizer_config.json").write_text('{"tokenizer_class": "XLMTokenizer"}')
    with pytest.raises(UserError, match="not 'a b"):
        load_tokenizer(broken)
    monkeypatch.setitem(sys.modules, "sacremoses", None)  # as when it is not installed
    with pytest.raises(UserError, match=r"pip install 'pretext-jax\[xlm\]'"):
        load_tokenizer(xlm_folders["lowercased"])


def test_xlm_streams_read_each_language_by_its_moses_rules(xlm_folders, tmp_path):
    """XLM's monolingual streams with an XLM folder as data.tokenizer: each corpus is tokenised
    with Moses' rules of its language (`data.language` per corpus), as XLM's tokenize.sh does,
    and tagged with the checkpoint's language id (XLM-15's table: en 4, fr 6); English rules on
    the French text give other ids (the control)."""
    from pretext_jax.input_pipeline.examples import xlm as xlm_examples
    from pretext_jax.input_pipeline.prepare import DataConfig

    corpora = {}
    for language in ("en", "fr"):
        corpora[language] = str(tmp_path / f"{language}.txt")
        Path(corpora[language]).write_text("\n\n".join(["\n".join(FALLBACK[language])] * 8))
    data = DataConfig(source="", tokenizer=str(xlm_folders["lowercased"]),
                      held_out_fraction=0.25)
    mono, tokenizer = xlm_examples.prepare_streams(
        corpora, data, xlm_examples.XLMExampleConfig(), tmp_path / "cache", 0)
    ours = load_tokenizer(xlm_folders["lowercased"])
    for language, (train, held) in mono.items():
        streamed = collections.Counter()
        for records in (train, held):
            rows = records.examples(range(len(records)))
            ids = rows["input_ids"][rows["input_mask"] > 0]
            streamed.update(ids[ids != tokenizer.eos_id].tolist())
            assert set(rows["langs"][rows["input_mask"] > 0].tolist()) == {
                {"en": 4, "fr": 6}[language]}
        expected = collections.Counter(i for line in FALLBACK[language] * 8
                                       for i in ours.for_language(language).encode(line))
        assert streamed == expected, language
    english = collections.Counter(i for line in FALLBACK["fr"] * 8 for i in ours.encode(line))
    assert english != expected
    # The run's model has the checkpoint's 15 language embeddings, so its ids index them.
    from pretext_jax.pretrain.config import make_config
    from pretext_jax.pretrain.trainer import Trainer

    trainer = Trainer(make_config("xlm_tiny", {
        "data.source": ",".join(f"{lang}={path}" for lang, path in corpora.items()),
        "data.tokenizer": str(xlm_folders["lowercased"]), "data.held_out_fraction": 0.25,
        "data.cache_dir": str(tmp_path / "cache")}), tmp_path / "w")
    assert trainer.model_config.n_langs == 15
