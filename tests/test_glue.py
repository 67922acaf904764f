"""GLUE data and metrics: metrics equal scikit-learn / scipy, the encoding equals BERT's layout
(checked against HF `BertTokenizer`), XLNet's (against HF `XLNetTokenizer`) and RoBERTa's
(against HF `RobertaTokenizer`), the real TSV
files give GLUE's published counts, TFDS glue prepared as ArrayRecord on disk is read (never
downloaded), and one-line errors for bad input."""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
from parity_utils import xlnet_spiece
from tfds_utils import build_glue_dataset

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.glue import (
    GLUE_TASKS,
    GlueSplit,
    encode_glue,
    glue_fingerprint,
    glue_task,
    read_glue,
    read_glue_tfds,
    read_glue_tsv,
    truncate_seq_pair,
)
from pretext_jax.input_pipeline.tokenizers import SPECIALS, WordPieceTokenizer, load_tokenizer
from pretext_jax.objectives.common import glue_metrics

# ---------------------------------------------------------------------------------- metrics


def classification_cases() -> list[tuple[np.ndarray, np.ndarray]]:
    """Random (predictions, labels) with 2-4 classes, plus constant and one-class cases."""
    rng = np.random.default_rng(0)
    cases = []
    for _ in range(300):
        size, classes = int(rng.integers(1, 40)), int(rng.integers(2, 5))
        cases.append((rng.integers(0, classes, size), rng.integers(0, classes, size)))
    labels = rng.integers(0, 2, 25)
    cases += [(np.zeros(25, int), labels), (np.ones(25, int), labels),
              (labels, np.ones(25, int)), (labels, np.zeros(25, int)),
              (np.ones(25, int), np.ones(25, int)), (np.zeros(25, int), np.zeros(25, int)),
              (labels, labels), (1 - labels, labels), (np.array([2, 2, 0]), np.array([1, 1, 1]))]
    return cases


@pytest.mark.filterwarnings("ignore:A single label was found")
def test_classification_metrics_match_sklearn():
    metrics = pytest.importorskip("sklearn.metrics")
    for predictions, labels in classification_cases():
        assert glue_metrics.accuracy(predictions, labels) == pytest.approx(
            metrics.accuracy_score(labels, predictions), abs=1e-12)
        assert glue_metrics.matthews_corrcoef(predictions, labels) == pytest.approx(
            metrics.matthews_corrcoef(labels, predictions), abs=1e-12)
        binary_predictions, binary_labels = predictions % 2, labels % 2
        assert glue_metrics.f1_score(binary_predictions, binary_labels) == pytest.approx(
            metrics.f1_score(binary_labels, binary_predictions, zero_division=0.0), abs=1e-12)


def regression_cases() -> list[tuple[np.ndarray, np.ndarray]]:
    """Random scores, scores on STS-B's 0.2 grid (many ties), constant and monotone cases."""
    rng = np.random.default_rng(1)
    cases = []
    for _ in range(200):
        size = int(rng.integers(2, 60))
        labels = np.round(rng.uniform(0, 5, size) * 5) / 5
        predictions = labels + rng.normal(0, rng.uniform(0.1, 3), size)
        if rng.random() < 0.5:
            predictions = np.round(predictions)
        cases.append((predictions.astype(np.float32), labels.astype(np.float32)))
    labels = np.linspace(0, 5, 30)
    cases += [(np.full(30, 2.5), labels), (labels, np.full(30, 3.0)), (labels**3, labels),
              (-labels, labels), (np.array([1.0, 2.0]), np.array([4.0, 0.5])),
              (np.array([0.0, 1, 1, 1, 2]), np.array([3.0, 3, 1, 1, 0]))]
    return cases


def test_correlations_match_scipy():
    stats = pytest.importorskip("scipy.stats")
    for predictions, labels in regression_cases():
        with warnings.catch_warnings():  # scipy warns on constant input and returns NaN
            warnings.simplefilter("ignore")
            exact = predictions.astype(np.float64), labels.astype(np.float64)
            expected_pearson = stats.pearsonr(*exact)[0]
            expected_spearman = stats.spearmanr(*exact)[0]
        np.testing.assert_allclose(glue_metrics.pearson(predictions, labels), expected_pearson,
                                   rtol=1e-9, atol=1e-12, equal_nan=True)
        np.testing.assert_allclose(glue_metrics.spearman(predictions, labels),
                                   expected_spearman, rtol=1e-9, atol=1e-12, equal_nan=True)


def test_task_metrics_names_and_main_metric():
    labels = np.array([0, 1, 1, 0, 1])
    predictions = np.array([0, 1, 0, 0, 1])
    mrpc = glue_metrics.task_metrics(glue_task("mrpc"), predictions, labels)
    assert set(mrpc) == {"f1", "accuracy", "glue_score"}
    assert mrpc["accuracy"] == pytest.approx(0.8) and mrpc["f1"] == pytest.approx(0.8)
    assert mrpc["glue_score"] == pytest.approx(0.8)
    scores = np.array([0.0, 1.2, 3.4, 5.0])
    stsb = glue_metrics.task_metrics(glue_task("stsb"), np.array([0.0, 2, 3, 4]), scores)
    assert set(stsb) == {"pearson", "spearman", "glue_score"} and stsb["spearman"] == 1.0
    assert stsb["glue_score"] == pytest.approx((stsb["pearson"] + 1.0) / 2)
    expected_names = {"sst2": {"accuracy"}, "cola": {"matthews_corrcoef"}, "rte": {"accuracy"}}
    for name, names in expected_names.items():
        assert set(glue_metrics.task_metrics(glue_task(name), predictions, labels)) == (
            names | {"glue_score"})
    for task in GLUE_TASKS.values():
        values = scores if task.is_regression else labels
        assert task.main_metric in glue_metrics.task_metrics(task, values, values)


def test_task_registry():
    for alias, name in [("SST-2", "sst2"), ("sst-2", "sst2"), ("CoLA", "cola"), ("MRPC", "mrpc"),
                        ("Rte", "rte"), ("STS-B", "stsb"), ("stsb", "stsb")]:
        assert glue_task(alias) is GLUE_TASKS[name]
    assert [GLUE_TASKS[n].num_labels for n in ("sst2", "cola", "mrpc", "rte", "stsb")] == [
        2, 2, 2, 2, 1]
    assert GLUE_TASKS["rte"].labels == ("entailment", "not_entailment")
    assert not GLUE_TASKS["sst2"].is_pair and GLUE_TASKS["stsb"].is_pair
    with pytest.raises(UserError, match=r"unknown GLUE task 'qnli'; use one of sst2 \(SST-2\)"):
        glue_task("qnli")


# --------------------------------------------------------------------------------- encoding

WORDS = ["the", "cat", "sat", "on", "mat", "dog", "ran", "fast", "a", "big", "red", "house"]
TEXT_WORDS = WORDS + ["cats", "running", "Zebra", "dogs.", "houses,", "The"]


def write_vocab(tmp_path) -> str:
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join([*SPECIALS, *WORDS, "##s", "##ing", ".", ","]) + "\n")
    return str(path)


def bert_pair_lengths(len_a: int, len_b: int, budget: int) -> tuple[int, int]:
    """What run_classifier.py `_truncate_seq_pair` keeps, restated in closed form: the shorter
    sequence is kept whole if it fits in half the budget and the longer one fills the rest;
    otherwise both get half, and A the extra token of an odd budget (the loop pops B on ties)."""
    if len_a + len_b <= budget:
        return len_a, len_b
    if min(len_a, len_b) <= budget // 2:
        return (len_a, budget - len_a) if len_a <= len_b else (budget - len_b, len_b)
    return budget - budget // 2, budget // 2


def test_truncate_seq_pair_matches_bert_closed_form():
    for len_a in range(12):
        for len_b in range(12):
            for budget in range(20):
                tokens_a, tokens_b = list(range(len_a)), list(range(100, 100 + len_b))
                truncate_seq_pair(tokens_a, tokens_b, budget)
                kept = bert_pair_lengths(len_a, len_b, budget)
                assert (len(tokens_a), len(tokens_b)) == kept
                assert tokens_a == list(range(kept[0]))  # tokens leave from the end
                assert tokens_b == list(range(100, 100 + kept[1]))


def test_encoding_layout_by_hand(tmp_path):
    tokenizer = WordPieceTokenizer.from_vocab_file(write_vocab(tmp_path))
    cls, sep, pad = tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id
    the, cat, sat, dog = (tokenizer.vocab[w] for w in ("the", "cat", "sat", "dog"))
    pair = encode_glue(GlueSplit(["the cat sat", "the cat"], ["the dog", ""],
                                 np.array([1, 0], np.int32)), tokenizer, 8)
    assert pair["input_ids"].tolist() == [[cls, the, cat, sat, sep, the, dog, sep],
                                          [cls, the, cat, sep, pad, pad, pad, pad]]
    assert pair["token_type_ids"].tolist() == [[0, 0, 0, 0, 0, 1, 1, 1], [0] * 8]
    assert pair["attention_mask"].tolist() == [[1] * 8, [1, 1, 1, 1, 0, 0, 0, 0]]
    assert pair["label"].tolist() == [1, 0]
    assert all(pair[k].dtype == np.int32 for k in ("input_ids", "token_type_ids",
                                                   "attention_mask", "label"))
    single = encode_glue(GlueSplit(["the cat sat"], None, np.array([2.5], np.float32)),
                         tokenizer, 4)
    assert single["input_ids"].tolist() == [[cls, the, cat, sep]]
    assert single["label"].dtype == np.float32
    assert encode_glue(GlueSplit(["the"], ["dog"], np.zeros(1, np.int32)), tokenizer,
                       3)["input_ids"].tolist() == [[cls, sep, sep]]


def test_encoding_matches_hf_bert_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    vocab = write_vocab(tmp_path)
    reference = transformers.BertTokenizer(vocab, do_lower_case=True)
    tokenizer = WordPieceTokenizer.from_vocab_file(vocab, lowercase=True)
    rng = random.Random(0)
    truncated = hf_ties = 0
    for _ in range(300):
        text_a, text_b = (" ".join(rng.choices(TEXT_WORDS, k=rng.randint(1, 12)))
                          for _ in range(2))
        max_length = rng.randint(3, 26)
        ours = encode_glue(GlueSplit([text_a], [text_b], np.zeros(1, np.int32)), tokenizer,
                           max_length)
        ours = {k: ours[k][0].tolist() for k in ("input_ids", "token_type_ids",
                                                  "attention_mask")}
        tokens_a = reference.encode(text_a, add_special_tokens=False)
        tokens_b = reference.encode(text_b, add_special_tokens=False)
        budget = max_length - 3
        keep_a, keep_b = bert_pair_lengths(len(tokens_a), len(tokens_b), budget)
        truncated += keep_a + keep_b < len(tokens_a) + len(tokens_b)
        ids = [reference.cls_token_id, *tokens_a[:keep_a], reference.sep_token_id,
               *tokens_b[:keep_b], reference.sep_token_id]
        padding = max_length - len(ids)
        assert ours == {"input_ids": ids + [reference.pad_token_id] * padding,
                        "token_type_ids": [0] * (keep_a + 2) + [1] * (keep_b + 1)
                        + [0] * padding,
                        "attention_mask": [1] * len(ids) + [0] * padding}
        hf = reference(text_a, text_b, truncation="longest_first", max_length=max_length,
                       padding="max_length")
        # When both sequences exceed half of an odd budget and A is not the longer one, HF's
        # (Rust) "longest_first" gives the extra token to B, while BERT's _truncate_seq_pair
        # pops B on ties so that A keeps it. Only those cases are checked against the closed
        # form above instead of HF.
        if budget % 2 and budget // 2 < len(tokens_a) <= len(tokens_b):
            hf_ties += 1
            assert hf["token_type_ids"].index(1) == keep_a + 1  # HF: one A token fewer
        else:
            assert {k: hf[k] for k in ours} == ours
        single = encode_glue(GlueSplit([text_a], None, np.zeros(1, np.int32)), tokenizer,
                             max_length - 1)
        hf_single = reference(text_a, truncation="longest_first", max_length=max_length - 1,
                              padding="max_length")
        assert {k: single[k][0].tolist() for k in ours} == {k: hf_single[k] for k in ours}
    assert truncated > 100 and hf_ties > 20
    empty_b = encode_glue(GlueSplit(["the big cat"], [""], np.zeros(1, np.int32)), tokenizer, 8)
    hf_empty = reference("the big cat", "", max_length=8, padding="max_length")
    assert empty_b["input_ids"][0].tolist() == hf_empty["input_ids"]


def test_xlnet_layout_by_hand(tmp_path):
    """classifier_utils.py `convert_single_example`: A <sep> (B <sep>) <cls> with segment ids
    0, 1 and 2, padded on the left with segment id 4."""
    tokenizer = WordPieceTokenizer.from_vocab_file(write_vocab(tmp_path))
    cls, sep, pad = tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id
    the, cat, sat, dog = (tokenizer.vocab[w] for w in ("the", "cat", "sat", "dog"))
    pair = encode_glue(GlueSplit(["the cat sat", "the cat"], ["the dog", ""],
                                 np.array([1, 0], np.int32)), tokenizer, 8, "xlnet")
    assert pair["input_ids"].tolist() == [[the, cat, sat, sep, the, dog, sep, cls],
                                          [pad, pad, pad, pad, the, cat, sep, cls]]
    assert pair["token_type_ids"].tolist() == [[0, 0, 0, 0, 1, 1, 1, 2],
                                               [4, 4, 4, 4, 0, 0, 0, 2]]
    assert pair["attention_mask"].tolist() == [[1] * 8, [0, 0, 0, 0, 1, 1, 1, 1]]
    single = encode_glue(GlueSplit(["the cat sat"], None, np.zeros(1, np.int32)), tokenizer, 4,
                         "xlnet")
    assert single["input_ids"].tolist() == [[the, cat, sep, cls]]
    assert encode_glue(GlueSplit(["the"], ["dog"], np.zeros(1, np.int32)), tokenizer, 3,
                       "xlnet")["input_ids"].tolist() == [[sep, sep, cls]]
    with pytest.raises(UserError, match="examples.layout='gpt' is unknown"):
        encode_glue(GlueSplit(["the"], None, np.zeros(1, np.int32)), tokenizer, 4, "gpt")


def test_xlnet_encoding_matches_hf_xlnet_tokenizer(tmp_path):
    """Our XLNet sentencepiece tokenizer and layout equal HF `XLNetTokenizer` (on a vocabulary
    laid out as XLNet's) wherever nothing is truncated; HF pads the segment ids with 0 where the
    TF code uses 4 (either is masked)."""
    transformers = pytest.importorskip("transformers")
    rng = random.Random(0)
    words = [*TEXT_WORDS, "Café", "naïve", "``quoted''"]  # accents stripped, quotes replaced
    xlnet_spiece(tmp_path, [" ".join(rng.choices(words, k=9)) for _ in range(300)], 60)
    reference = transformers.XLNetTokenizer.from_pretrained(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    assert (tokenizer.pad_id, tokenizer.cls_id, tokenizer.sep_id) == (
        reference.pad_token_id, reference.cls_token_id, reference.sep_token_id)
    for _ in range(100):
        texts = [" ".join(rng.choices(words, k=rng.randint(1, 8))) for _ in range(2)]
        for text_b in (texts[1], None):
            ours = encode_glue(GlueSplit(texts[:1], None if text_b is None else [text_b],
                                         np.zeros(1, np.int32)), tokenizer, 80, "xlnet")
            hf = reference(texts[0], text_b, padding="max_length", max_length=80,
                           return_token_type_ids=True)
            real = np.asarray(hf["attention_mask"]) == 1
            assert ours["input_ids"][0].tolist() == hf["input_ids"]
            assert ours["attention_mask"][0].tolist() == hf["attention_mask"]
            assert ours["token_type_ids"][0][real].tolist() == np.asarray(
                hf["token_type_ids"])[real].tolist()
            assert set(ours["token_type_ids"][0][~real].tolist()) <= {4}


def test_roberta_encoding_matches_hf_roberta_tokenizer(tmp_path):
    """The roberta layout with a byte-level BPE equals HF `RobertaTokenizer`'s pair and single
    encoding: `<s> A </s></s> B </s>`, token types 0, padded with <pad>; truncated pairs keep
    max_length - 4 tokens (one A token at most on a tie, as `truncate_seq_pair`)."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    rng = random.Random(0)
    trainer = tokenizers.ByteLevelBPETokenizer()
    trainer.train_from_iterator([" ".join(rng.choices(TEXT_WORDS, k=9)) for _ in range(300)],
                                vocab_size=300, show_progress=False, special_tokens=[
                                    "<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    trainer.save_model(str(tmp_path))
    reference = transformers.RobertaTokenizer.from_pretrained(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    for _ in range(50):
        texts = [" ".join(rng.choices(TEXT_WORDS, k=rng.randint(1, 8))) for _ in range(2)]
        for text_b in (texts[1], None):
            ours = encode_glue(GlueSplit(texts[:1], None if text_b is None else [text_b],
                                         np.zeros(1, np.int32)), tokenizer, 64, "roberta")
            hf = reference(texts[0], text_b, padding="max_length", max_length=64,
                           return_token_type_ids=True)
            assert {k: ours[k][0].tolist() for k in hf} == dict(hf)
    short = encode_glue(GlueSplit(["the cat sat"], ["the dog"], np.zeros(1, np.int32)),
                        tokenizer, 7, "roberta")["input_ids"][0].tolist()
    the = reference.encode("the", add_special_tokens=False)  # 3 tokens left: A 2, B 1
    assert short == [reference.cls_token_id, *reference.encode("the cat", add_special_tokens=False),
                     reference.sep_token_id, reference.sep_token_id, *the, reference.sep_token_id]


# ------------------------------------------------------------------------------- real files

EXPECTED = {  # rows and label counts per id, from /work/shared/data/README.md (GLUE's sizes)
    ("sst2", "train"): (67349, [29780, 37569]), ("sst2", "dev"): (872, [428, 444]),
    ("cola", "train"): (8551, [2528, 6023]), ("cola", "dev"): (1043, [322, 721]),
    ("mrpc", "train"): (3668, [1194, 2474]), ("mrpc", "dev"): (408, [129, 279]),
    ("rte", "train"): (2490, [1249, 1241]), ("rte", "dev"): (277, [146, 131]),
    ("stsb", "train"): (5749, None), ("stsb", "dev"): (1500, None),
}


@pytest.fixture
def glue_root(shared_data):
    path = shared_data / "glue"
    if not path.is_dir():
        pytest.skip(f"GLUE files not found at {path}")
    return path


@pytest.mark.parametrize("name,split", list(EXPECTED))
def test_real_glue_counts(glue_root, name, split):
    rows, counts = EXPECTED[name, split]
    data = read_glue_tsv(glue_root, name, split)
    assert len(data.texts_a) == len(data.labels) == rows
    assert (data.texts_b is not None) == GLUE_TASKS[name].is_pair
    assert data.texts_b is None or len(data.texts_b) == rows
    if counts is None:
        assert data.labels.dtype == np.float32
        assert data.labels.min() == 0.0 and data.labels.max() == 5.0
    else:
        assert data.labels.dtype == np.int32
        assert np.bincount(data.labels).tolist() == counts


def test_a_tasks_cache_key_is_its_training_file(tmp_path):
    """The key of a task's cached records names its train.tsv: a file added elsewhere in the
    GLUE root (another task, a cache kept there) leaves it, the task's file edited changes it,
    and the root and the task folder give the same key."""
    for task, rows in (("SST-2", "sentence\tlabel\ngood film\t1\n"),
                       ("CoLA", "gj04\t1\t\tgood\n")):
        (tmp_path / task).mkdir()
        (tmp_path / task / "train.tsv").write_text(rows)
    key = glue_fingerprint(str(tmp_path), "sst2")
    assert key and key == glue_fingerprint(str(tmp_path / "SST-2"), "sst2")
    (tmp_path / "CoLA" / "dev.tsv").write_text("gj04\t0\t\tbad\n")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "records").write_text("x")
    assert glue_fingerprint(str(tmp_path), "sst2") == key
    (tmp_path / "SST-2" / "train.tsv").write_text("sentence\tlabel\nbad film plot\t0\n")
    assert glue_fingerprint(str(tmp_path), "sst2") != key
    assert glue_fingerprint(str(tmp_path), "cola") != glue_fingerprint(str(tmp_path), "sst2")


def test_real_glue_folder_forms(glue_root):
    by_root = read_glue(str(glue_root), "MRPC", "validation")
    by_folder = read_glue(str(glue_root / "MRPC"), "mrpc", "dev")
    assert by_root.texts_a == by_folder.texts_a and by_root.texts_b == by_folder.texts_b
    assert by_root.texts_b[0].startswith('"The foodservice pie business')  # quotes kept


# ------------------------------------------------------------------------------------- TFDS


def glue_rows(task: str, count: int, seed: int = 0) -> list[dict]:
    """`count` rows of random words with the task's TFDS features and labels."""
    rng = np.random.default_rng(seed)
    spec = glue_task(task)
    rows = []
    for _ in range(count):
        row = {spec.tfds_text_a: " ".join(rng.choice(["good", "bad", "film", "plot"], 4))}
        if spec.tfds_text_b:
            row[spec.tfds_text_b] = " ".join(rng.choice(["the", "a", "story"], 3))
        row["label"] = (float(rng.uniform(0, 5)) if spec.is_regression
                        else int(rng.integers(spec.num_labels)))
        rows.append(row)
    return rows


@pytest.fixture(scope="module")
def tfds_glue(tmp_path_factory):
    """TFDS glue/{sst2,rte,stsb,cola} prepared as ArrayRecord on disk: 6 train and 4 validation
    rows each; cola's test split has GLUE's hidden labels (-1)."""
    root = tmp_path_factory.mktemp("tensorflow_datasets")
    for task in ("sst2", "rte", "stsb", "cola"):
        splits = {"train": glue_rows(task, 6), "validation": glue_rows(task, 4, seed=1)}
        if task == "cola":
            splits["test"] = [{**row, "label": -1} for row in glue_rows(task, 2)]
        build_glue_dataset(root, task, splits)
    return str(root)


@pytest.mark.parametrize("spec,name,split,pair", [
    ("tfds", "sst2", "dev", False), ("tfds:glue", "RTE", "train", True),
    ("tfds:glue/stsb", "stsb", "validation", True), ("tfds", "cola", "train", False),
])
def test_tfds_glue_prepared_on_disk(spec, name, split, pair, tfds_glue):
    data = read_glue(spec, name, split, tfds_glue)
    tfds_split = "validation" if split == "dev" else split
    rows = glue_rows(name.lower(), 6 if tfds_split == "train" else 4,
                     seed=0 if tfds_split == "train" else 1)
    task = glue_task(name)
    assert data.texts_a == [row[task.tfds_text_a] for row in rows]
    assert (data.texts_b is not None) == pair
    if pair:
        assert data.texts_b == [row[task.tfds_text_b] for row in rows]
    if task.is_regression:
        assert data.labels.dtype == np.float32
        np.testing.assert_allclose(data.labels, [row["label"] for row in rows], rtol=1e-6)
    else:
        assert data.labels.dtype == np.int32
        assert data.labels.tolist() == [row["label"] for row in rows]


def test_tfds_errors(tmp_path, tfds_glue):
    with pytest.raises(UserError, match=r"glue/sst2 is not prepared in .*`tfds build glue/sst2 "
                                        r"--file_format=array_record --data_dir=") as error:
        read_glue_tfds("sst2", "train", data_dir=str(tmp_path))
    assert "\n" not in str(error.value)
    with pytest.raises(UserError, match="not the TFDS config of GLUE task sst2"):
        read_glue("tfds:glue/cola", "sst2", "train")
    with pytest.raises(UserError, match=r"label -1 \(GLUE test labels are hidden\)"):
        read_glue("tfds", "cola", "test", tfds_glue)


# ----------------------------------------------------------------------------------- errors

RTE_HEADER = "index\tsentence1\tsentence2\tlabel\n"


@pytest.mark.parametrize("task,content,message", [
    ("rte", RTE_HEADER + "0\ta\tb\tentailment\n1\ta\tnot_entailment\n",
     r"RTE/train.tsv line 3 has 3 tab-separated columns, not 4"),
    ("rte", RTE_HEADER + "0\ta\tb\tcontradiction\n",
     r"RTE/train.tsv line 2: label 'contradiction' is not one of entailment, not_entailment"),
    ("rte", "sentence\tlabel\nit is fine\t1\n", r"line 1: header 'sentence \| label' is not"),
    ("stsb", "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2"
     "\tscore\n0\tg\tf\ty\t0\tnone\tnone\ta\tb\t7.5\n", r"line 2: score '7.5' is not a number"),
    ("cola", "gj04\t2\t\tA sentence.\n", r"CoLA/train.tsv line 1: label '2' is not one of 0, 1"),
    ("rte", RTE_HEADER, "has no data rows"),
])
def test_bad_rows(tmp_path, task, content, message):
    folder = tmp_path / glue_task(task).folder
    folder.mkdir()
    (folder / "train.tsv").write_text(content)
    with pytest.raises(UserError, match=message) as error:
        read_glue_tsv(tmp_path, task, "train")
    assert "\n" not in str(error.value)


def test_bad_files_and_arguments(tmp_path):
    with pytest.raises(UserError, match=r"GLUE file .*SST-2/dev.tsv not found") as error:
        read_glue(str(tmp_path), "sst2", "validation")
    assert "\n" not in str(error.value)
    folder = tmp_path / "SST-2"
    folder.mkdir()
    (folder / "train.tsv").write_bytes(b"sentence\tlabel\nfine\t1\ncaf\xe9\t0\n")
    with pytest.raises(UserError, match=r"train.tsv line 3 is not UTF-8 \(bad byte at offset "
                       r"25\)"):
        read_glue_tsv(folder, "sst2", "train")
    mrpc = tmp_path / "MRPC"
    mrpc.mkdir()
    (mrpc / "dev.tsv").write_text("\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
                                  '1\t1\t2\t"Quoted\tplain "half\n', encoding="utf-8")
    data = read_glue_tsv(mrpc, "mrpc", "dev")  # byte-order mark dropped, quotes kept
    assert (data.texts_a, data.texts_b, data.labels.tolist()) == (['"Quoted'], ['plain "half'],
                                                                   [1])
    with pytest.raises(UserError, match="GLUE test labels are hidden"):
        read_glue_tsv(tmp_path, "mrpc", "test")
    split = GlueSplit(["a"], ["b"], np.zeros(1, np.int32))
    tokenizer = WordPieceTokenizer.from_vocab_file(write_vocab(tmp_path))
    with pytest.raises(UserError, match="max_seq_length=2 is shorter than the 3 special"):
        encode_glue(split, tokenizer, 2)
    with pytest.raises(UserError, match="max_seq_length=1 is shorter than the 2 special"):
        encode_glue(GlueSplit(["a"], None, split.labels), tokenizer, 1)
