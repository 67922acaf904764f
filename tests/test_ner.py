"""Token classification (named entities, method `tag`): the CoNLL reader and word-piece windows,
the entity-level metric against seqeval, the head against HF `*ForTokenClassification`, and one
`run.py finetune --task ner` / `eval` on tiny files."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from parity_utils import classifier_parity, converted, family_inputs, hf_reference

from pretext_jax import (
    objectives,  # noqa: F401  (registers the methods)
    run,
)
from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import conll
from pretext_jax.input_pipeline.tokenizers import WordPieceTokenizer
from pretext_jax.models.classifier import TokenClassifier
from pretext_jax.objectives.tagging import entities, entity_scores
from pretext_jax.pretrain.finetune import finetune_config

WORDS = ["paris", "london", "bob", "alice", "went", "to", "saw", "the", "and", "##s", "city"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
TAGS = {"paris": "B-LOC", "london": "B-LOC", "bob": "B-PER", "alice": "B-PER"}


def write_conll(path, rng: np.random.Generator, count: int) -> None:
    """Sentences of random words; the names' tags follow the word, a second piece ('##s')
    sometimes trails a name; `-DOCSTART-` first, as CoNLL-2003."""
    lines = ["-DOCSTART- -X- O O", ""]
    for _ in range(count):
        for word in rng.choice(WORDS[:-2] + ["city"], 6):
            lines.append(f"{word}\t{TAGS.get(word, 'O')}")
        lines.append("")
    path.write_text("\n".join(lines))


@pytest.fixture(scope="module")
def ner_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ner")
    rng = np.random.default_rng(0)
    write_conll(folder / "train.txt", rng, 64)
    write_conll(folder / "dev.txt", rng, 24)
    return folder


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    """A tiny random HF BERT with the vocab above."""
    path = tmp_path_factory.mktemp("bert")
    hf_reference("BertForPreTraining", 0, vocab_size=len(VOCAB), hidden_size=32,
                 num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 max_position_embeddings=64, type_vocab_size=2).save_pretrained(path)
    (path / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    (path / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True}))
    return str(path)


# ---------------------------------------------------------------------------- metric
HAND_MADE = {  # tags -> conlleval's entities
    "bio": (["B-PER", "I-PER", "O", "B-LOC"], {("PER", 0, 1), ("LOC", 3, 3)}),
    "I- after O starts one": (["O", "I-PER", "I-PER", "O"], {("PER", 1, 2)}),
    "type change splits": (["B-PER", "I-LOC", "I-LOC"], {("PER", 0, 0), ("LOC", 1, 2)}),
    "B- after B-": (["B-PER", "B-PER"], {("PER", 0, 0), ("PER", 1, 1)}),
    "bioes": (["S-LOC", "B-PER", "I-PER", "E-PER", "O", "S-ORG"],
              {("LOC", 0, 0), ("PER", 1, 3), ("ORG", 5, 5)}),
    "E- ends, I- after E- starts": (["B-PER", "E-PER", "I-PER"], {("PER", 0, 1), ("PER", 2, 2)}),
}


@pytest.mark.parametrize("case", HAND_MADE)
def test_entities_on_hand_made_cases(case):
    tags, expected = HAND_MADE[case]
    assert entities(tags) == expected


def test_entity_scores_equal_seqeval():
    seqeval = pytest.importorskip("seqeval.metrics")
    rng = np.random.default_rng(0)
    tags = ["O", "B-PER", "I-PER", "E-PER", "S-PER", "B-LOC", "I-LOC", "S-LOC"]
    gold = [[str(t) for t in rng.choice(tags, rng.integers(1, 9))] for _ in range(300)]
    predicted = [[t if rng.random() < 0.7 else str(rng.choice(tags)) for t in s] for s in gold]
    ours = entity_scores(gold, predicted)
    for name, function in (("f1", seqeval.f1_score), ("precision", seqeval.precision_score),
                           ("recall", seqeval.recall_score)):
        assert ours[name] == pytest.approx(function(gold, predicted), abs=1e-12), name
    # negative control: the scores see a change of one entity's end
    assert 0 < ours["f1"] < 1
    assert entity_scores([["B-PER", "I-PER"]], [["B-PER", "O"]])["f1"] == 0.0
    assert entity_scores([["O", "O"]], [["O", "O"]]) == {"f1": 0.0, "precision": 0.0,
                                                         "recall": 0.0}


# ---------------------------------------------------------------------------- data
def test_reader_skips_docstart_takes_the_last_column_and_names_bad_lines(tmp_path):
    good = tmp_path / "eng.train"
    good.write_text("-DOCSTART- -X- O O\n\nEU NNP B-NP S-ORG\nrejects VBZ B-VP O\n\n\n"
                    "Peter\tB-PER\nBlackburn\tE-PER\n")
    read = conll.read_conll(good)
    assert read.words == [["EU", "rejects"], ["Peter", "Blackburn"]]
    assert read.tags == [["S-ORG", "O"], ["B-PER", "E-PER"]]
    assert conll.label_set(read) == ("O", "B-PER", "E-PER", "S-ORG")
    for text, line, fix in (("a\tO\nb\n", 2, "no tag"), ("a\tO\n\nb\tPER\n", 3, "BIOES")):
        bad = tmp_path / "bad.txt"
        bad.write_text(text)
        with pytest.raises(UserError, match=rf"bad.txt line {line}\b.*{fix}"):
            conll.read_conll(bad)
    with pytest.raises(UserError, match="no train file"):
        conll.split_file(tmp_path, "train")
    assert conll.split_file(f"{good},{good}", "dev") == good


def test_first_piece_labelled_and_long_sentences_windowed():
    tokenizer = WordPieceTokenizer(VOCAB, lowercase=True)
    words = ["Paris", "cities", "went", "bob", "went", "to", "the", "city", "and", "alice"]
    tags = ["B-LOC", "O", "O", "B-PER", "O", "O", "O", "O", "O", "B-PER"]
    labels = ("O", "B-LOC", "B-PER")
    sentences = conll.TaggedSentences([words], [tags])
    whole = conll.encode_tagged(sentences, labels, tokenizer, 16)
    assert len(whole["sentence"]) == 1
    pieces = [tokenizer.id_to_token(i) for i in whole["input_ids"][0][:13]]
    assert pieces[:4] == ["[CLS]", "paris", "[UNK]", "went"]  # 'cities' is one unknown piece
    assert list(whole["labels"][0][:5]) == [conll.IGNORE, 1, 0, 0, 2]
    assert list(whole["word"][0][:5]) == [-1, 0, 1, 2, 3]
    # 'citys' would be two pieces: only the first is labelled
    two = conll.encode_tagged(conll.TaggedSentences([["citys"]], [["B-LOC"]]),
                              labels, tokenizer, 8)
    assert list(two["labels"][0][:4]) == [conll.IGNORE, 1, conll.IGNORE, conll.IGNORE]
    # 4 pieces per window, stride 2: every word predicted from exactly one window, where it
    # has most context
    windows = conll.encode_tagged(sentences, labels, tokenizer, 6, stride=2)
    assert len(windows["sentence"]) == 4 and set(windows["sentence"]) == {0}
    owners = windows["word"][windows["word"] >= 0]
    assert sorted(owners) == list(range(len(words)))
    assert list(windows["word"][1]) == [-1, -1, 3, 4, -1, -1]  # pieces 2..5: 3 and 4 central
    for layout in ("xlnet", "xlm"):  # the layouts' special tokens around the same labels
        other = conll.encode_tagged(sentences, labels, tokenizer, 16, layout)
        np.testing.assert_array_equal(np.sort(other["labels"][0]), np.sort(whole["labels"][0]))
    with pytest.raises(UserError, match="stride"):
        conll.encode_tagged(sentences, labels, tokenizer, 6, stride=5)


def test_wnut17_split_sizes(shared_data):
    folder = shared_data / "wnut17"
    if not folder.is_dir():
        pytest.skip(f"WNUT-17 not found in {shared_data}")
    counts = [len(conll.read_conll(conll.split_file(folder, split)).words)
              for split in conll.SPLITS]
    assert counts == [3394, 1009, 1287]
    train = conll.read_conll(conll.split_file(folder, "train"))
    assert len(conll.label_set(train)) == 13  # O and B-/I- of six types


# ---------------------------------------------------------------------------- head
PARITY = {
    "BertForTokenClassification": dict(
        vocab_size=90, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=40, type_vocab_size=2),
    "ElectraForTokenClassification": dict(
        vocab_size=70, embedding_size=16, hidden_size=24, num_hidden_layers=2,
        num_attention_heads=3, intermediate_size=40, max_position_embeddings=40,
        type_vocab_size=2),
    "RobertaForTokenClassification": dict(
        vocab_size=90, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=40, type_vocab_size=1),
    "AlbertForTokenClassification": dict(
        vocab_size=70, embedding_size=16, hidden_size=24, num_hidden_layers=2,
        num_attention_heads=3, intermediate_size=40, max_position_embeddings=40,
        classifier_dropout_prob=0.3),
    "MPNetForTokenClassification": dict(
        vocab_size=61, hidden_size=24, num_hidden_layers=2, num_attention_heads=3,
        intermediate_size=40, max_position_embeddings=40),
    "XLNetForTokenClassification": dict(vocab_size=60, d_model=24, n_layer=2, n_head=3,
                                        d_inner=40),
    "XLMForTokenClassification": dict(vocab_size=60, emb_dim=24, n_layers=2, n_heads=3,
                                      n_langs=1, max_position_embeddings=30),
}


@pytest.mark.parametrize("architecture", PARITY)
def test_token_classifier_equals_hf_and_exports_back(architecture, tmp_path):
    pytest.importorskip("transformers")
    fields = {**PARITY[architecture], "num_labels": 5}
    reference = hf_reference(architecture, 1, **fields)
    model = converted(reference, tmp_path / "in")
    assert isinstance(model, TokenClassifier) and model.config.num_labels == 5
    family = architecture.removesuffix("ForTokenClassification").lower()
    ids, types, mask = family_inputs(family, fields["vocab_size"])
    if architecture.startswith("XLM"):
        ids, types = np.where(mask == 1, np.maximum(ids, 3), 2), np.zeros_like(ids)
    parity = classifier_parity(architecture)
    expected = parity.assert_parity(model, reference, ids, types, mask)
    assert expected["logits"].shape == (3, 17, 5)
    parity.round_trip(model, tmp_path / "out", ids, types, mask)


# ---------------------------------------------------------------------------- the run
def test_recipe_is_the_familys_and_the_cli_trains_and_evaluates(tmp_path, bert_dir, ner_folder,
                                                                capsys):
    from pretext_jax.pretrain.export import convert

    encoder = str(convert(bert_dir, tmp_path / "encoder", to="pretext"))  # a pretext model dir
    config = finetune_config("ner", encoder, str(ner_folder))
    assert config.method == "tag" and config.model.num_labels == 0
    assert (config.optim.learning_rate, config.train.batch_size) == (1e-4, 32)  # compact BERT
    workdir = tmp_path / "run"
    fast = ["examples.max_seq_length=12", "train.batch_size=16", "train.progress=false",
            "optim.learning_rate=3e-3"]
    assert run.main(["finetune", "--task", "ner", "--init", encoder, "--data", str(ner_folder),
                     "--workdir", str(workdir), "--epochs", "12", *fast]) == 0
    out = capsys.readouterr().out
    trained = out[out.index("ner dev after"):].strip()
    match = re.match(r"ner dev after \d+ steps: f1 ([0-9.]+) \(all-O 0.0000\), precision "
                     r"[0-9.]+ \(all-O 0.0000\), recall [0-9.]+ \(all-O 0.0000\)$", trained)
    assert match, trained
    assert float(match.group(1)) > 0.9  # the word decides its tag
    assert run.main(["eval", "--workdir", str(workdir)]) == 0
    assert capsys.readouterr().out.strip() == re.sub(r"after (\d+) steps", r"at step \1",
                                                     trained)
    # --seeds: one workdir per seed, each metric's median printed and saved
    sweep = tmp_path / "seeds"
    assert run.main(["finetune", "--task", "ner", "--init", encoder, "--data", str(ner_folder),
                     "--workdir", str(sweep), "--epochs", "2", "--seed", "3", "--seeds", "2",
                     *fast]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"ner dev, median of 2 seeds after \d+ steps: f1 [0-9.]+ \(all-O", printed)
    median = json.loads((sweep / "results.json").read_text())
    runs = [json.loads((sweep / f"seed{seed}" / "results.json").read_text()) for seed in (3, 4)]
    assert [r["seed"] for r in runs] == [3, 4] and median["seeds"] == [3, 4]
    assert median["runs"] == [r["dev"] for r in runs]
    for metric, value in median["dev"].items():
        assert value == pytest.approx(np.median([r["dev"][metric] for r in runs]))
    assert run.main(["convert", str(workdir), str(tmp_path / "hf"), "--to", "hf"]) == 0
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert saved["architectures"] == ["BertForTokenClassification"]
    assert len(saved["id2label"]) == 3  # O, B-LOC, B-PER
    capsys.readouterr()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "train.txt").write_text("paris\tB-LOC\nbob\n")
    (bad / "dev.txt").write_text("paris\tB-LOC\n")
    assert run.main(["finetune", "--task", "ner", "--init", bert_dir, "--data", str(bad),
                     "--workdir", str(tmp_path / "bad_run"), *fast]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "train.txt line 2" in err, err
    files = f"{bad / 'train.txt'},{bad / 'dev.txt'}"  # the TRAIN,DEV form reaches the reader
    assert run.main(["finetune", "--task", "ner", "--init", bert_dir, "--data", files,
                     "--workdir", str(tmp_path / "bad_run"), *fast]) == 2
    assert "train.txt line 2" in capsys.readouterr().err
    assert run.main(["finetune", "--task", "ner", "--init", bert_dir, "--data",
                     f"{files},{bad / 'test.txt'}", "--workdir", str(tmp_path / "bad_run")]) == 2
    assert f"--data {bad / 'test.txt'}: no such folder" in capsys.readouterr().err
