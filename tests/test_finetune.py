"""GLUE fine-tuning through the one trainer: the pre-trained encoder is the starting point, a
small model learns an easy task, results and evaluation agree, the paper recipes (incl.
ELECTRA's layer-wise learning-rate decay) are applied, seed sweeps report medians."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from parity_utils import classifier_parity, hf_reference, xlnet_spiece
from text_utils import labelled_sentences, write_glue_folder
from tfds_utils import build_glue_dataset

from pretext_jax import (
    objectives,  # noqa: F401  (registers the methods)
    run,
)
from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.glue import encode_glue, read_glue
from pretext_jax.input_pipeline.tokenizers import load_tokenizer
from pretext_jax.objectives import bert
from pretext_jax.objectives.classification import classification_loss
from pretext_jax.objectives.common.classifier_recipes import ClassifierSettings
from pretext_jax.pretrain import hf
from pretext_jax.pretrain.finetune import evaluate, finetune, finetune_config, run_glue
from pretext_jax.pretrain.loading import load_model
from pretext_jax.pretrain.optim import layer_depth_factors, make_optimizer
from pretext_jax.pretrain.trainer import Trainer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

WORDS = ["good", "bad", "movie", "film", "plot", "actors", "the", "a", "was", "is", "very",
         "really", "quite", "story", "music"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
TINY = dict(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=64, type_vocab_size=2)
FAST = ["examples.max_seq_length=16", "train.batch_size=16", "train.progress=false"]


def sentences(rng: np.random.Generator, count: int) -> tuple[list[str], np.ndarray]:
    return labelled_sentences(rng, count, WORDS)


@pytest.fixture(scope="module")
def glue_folder(tmp_path_factory):
    return write_glue_folder(tmp_path_factory.mktemp("glue"), WORDS, (192, 64), (48, 24))


def hf_folder(path, kind: str):
    """A small random HF BERT (BertForPreTraining) or ELECTRA discriminator with a vocab."""
    if kind == "bert":
        model = hf_reference("BertForPreTraining", 0, **TINY)
    else:
        model = hf_reference("ElectraForPreTraining", 0, **TINY, embedding_size=16)
    model.save_pretrained(path)
    (path / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    (path / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True}))
    return str(path)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return hf_folder(tmp_path_factory.mktemp("bert"), "bert")


def test_pretrained_encoder_is_the_starting_point_and_the_model_learns(tmp_path, bert_dir,
                                                                       glue_folder):
    config = finetune_config("sst2", bert_dir, glue_folder,
                             [*FAST, "optim.learning_rate=5e-3", "train.log_every=4"], epochs=4)
    assert config.train.steps == 4 * 12 and config.optim.warmup_steps == 5  # 10% of the steps
    assert config.optim.layerwise_lr_decay == 1.0 and config.optim.weight_decay == 0.01
    assert config.optim.schedule == "linear"  # BERT's optimization.py
    trainer = Trainer(config, tmp_path / "run")
    params = nnx.to_pure_dict(trainer.init_state().params)
    reference = hf.load(bert_dir)
    np.testing.assert_array_equal(
        params["encoder"]["embeddings"]["word_embeddings"]["embedding"],
        reference.encoder.embeddings.word_embeddings.embedding[...])
    np.testing.assert_array_equal(params["head_dense"]["kernel"], reference.pooler.kernel[...])
    result = finetune(config, tmp_path / "run")
    assert result["dev"]["accuracy"] > 0.9  # one word decides the label
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved["dev"] == result["dev"] and saved["steps"] == config.train.steps
    assert evaluate(tmp_path / "run")["dev"] == pytest.approx(result["dev"])
    # the majority class of the training labels, predicted for every dev row
    train = np.loadtxt(f"{glue_folder}/SST-2/train.tsv", dtype=str, delimiter="\t", skiprows=1)
    dev = np.loadtxt(f"{glue_folder}/SST-2/dev.tsv", dtype=str, delimiter="\t", skiprows=1)
    labels, counts = np.unique(train[:, 1], return_counts=True)
    majority_accuracy = float(np.mean(dev[:, 1] == labels[np.argmax(counts)]))
    assert result["majority_baseline"] == {"accuracy": majority_accuracy,
                                           "glue_score": majority_accuracy}
    assert not result["at_majority_baseline"] and saved["majority_baseline"]["accuracy"] < 0.6


def test_electra_recipe_regression_and_random_init(tmp_path, bert_dir, glue_folder):
    electra_dir = hf_folder(tmp_path / "electra", "electra")
    config = finetune_config("stsb", electra_dir, glue_folder, FAST)
    # ELECTRA Table 7 (Small): lr 3e-4, layer-wise decay 0.8, no weight decay, 10 epochs on STS-B.
    assert (config.optim.learning_rate, config.optim.layerwise_lr_decay,
            config.optim.weight_decay) == (3e-4, 0.8, 0.0)
    assert config.train.steps == 10 * 3 and config.model.num_labels == 1
    assert config.model.head == "electra"
    assert config.optim.schedule == "electra_linear"  # optimization.py's, not BERT's
    result = finetune(finetune_config("stsb", electra_dir, glue_folder,
                                      [*FAST, "train.steps=2"]), tmp_path / "stsb")
    assert set(result["dev"]) == {"pearson", "spearman", "glue_score"}
    assert result["majority_baseline"] == {"pearson": 0.0, "spearman": 0.0, "glue_score": 0.0}
    scratch = finetune_config("sst2", "", glue_folder, FAST, architecture=bert_dir)
    assert scratch.model.init == "" and scratch.model.hidden_size == 32
    trainer = Trainer(scratch, tmp_path / "scratch")
    params = nnx.to_pure_dict(trainer.init_state().params)
    assert not np.allclose(params["head_dense"]["kernel"], hf.load(bert_dir).pooler.kernel[...])


def test_xlnet_from_a_hf_folder(tmp_path, glue_folder):
    """XLNet (HF `XLNetLMHeadModel` + spiece.model): the recipe, XLNet's layout, the
    pre-trained transformer as the starting point, the model learns, results equal a fresh
    evaluation."""
    folder = tmp_path / "xlnet"
    folder.mkdir()
    rng = np.random.default_rng(1)
    vocab = xlnet_spiece(folder, sentences(rng, 300)[0], 60)
    hf_reference("XLNetLMHeadModel", 0, vocab_size=load_tokenizer(vocab).vocab_size, d_model=32,
                 n_layer=2, n_head=4, d_inner=64).save_pretrained(folder)
    recipe = finetune_config("sst2", str(folder), glue_folder, FAST)
    # XLNet Table 8 (MNLI): lr 2e-5, no weight decay, no layer-wise decay, Adam epsilon 1e-6.
    assert (recipe.optim.learning_rate, recipe.optim.weight_decay,
            recipe.optim.layerwise_lr_decay, recipe.optim.eps) == (2e-5, 0.0, 1.0, 1e-6)
    # model_utils.py get_train_op: tf.train.AdamOptimizer (eps before the bias correction),
    # poly decay from the peak at the end of warmup.
    assert recipe.optim.schedule == "linear_from_peak"
    assert recipe.optim.bias_correction and recipe.optim.eps_before_bias_correction
    assert recipe.model.head == "xlnet" and recipe.examples.layout == "xlnet"
    assert recipe.data.tokenizer == str(folder) and recipe.train.steps == 3 * 12
    config = finetune_config("sst2", str(folder), glue_folder,
                             [*FAST, "optim.learning_rate=5e-3", "train.log_every=4"], epochs=2)
    trainer = Trainer(config, tmp_path / "run")
    params = nnx.to_pure_dict(trainer.init_state().params)
    reference = hf.load(folder)
    np.testing.assert_array_equal(params["transformer"]["word_embedding"]["embedding"],
                                  reference.word_embedding.embedding[...])
    np.testing.assert_array_equal(params["transformer"]["layers"]["q"], reference.layers.q[...])
    result = finetune(config, tmp_path / "run")
    assert result["dev"]["accuracy"] > 0.9  # one word decides the label
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved["dev"] == result["dev"] and saved["steps"] == 2 * 12
    assert evaluate(tmp_path / "run")["dev"] == pytest.approx(result["dev"])


def test_xlnet_from_a_pretext_workdir_and_back_to_hf(tmp_path, glue_folder):
    """An XLNet pre-trained here (with memory) fine-tunes without it, from its own tokenizer;
    the fine-tuned classifier exports to HF `XLNetForSequenceClassification`."""
    workdir = tmp_path / "pretrained"
    assert run.main([
        "pretrain", "--preset", "xlnet_tiny", "--workdir", str(workdir), "model.hidden_size=16",
        "model.num_layers=1", "model.num_heads=2", "model.intermediate_size=32",
        "model.mem_len=12", "model.reuse_len=8", "examples.max_seq_length=16",
        "examples.reuse_len=8", "examples.perm_size=8", "examples.num_predict=3",
        "examples.num_streams=8", "data.vocab_size=600", f"data.cache_dir={tmp_path / 'cache'}",
        "train.steps=2", "train.batch_size=8", "train.eval_every=2", "train.eval_batches=1",
        "train.progress=false"]) == 0
    config = finetune_config("sst2", str(workdir), glue_folder, [*FAST, "train.steps=2"])
    assert config.data.tokenizer == str(workdir / "tokenizer")  # recorded by the trainer
    assert (config.model.memory_batch_size, config.model.mem_len) == (0, 0)
    trainer = Trainer(config, tmp_path / "run")
    params = nnx.to_pure_dict(trainer.init_state().params)
    pretrained = load_model(workdir)
    np.testing.assert_array_equal(params["transformer"]["layers"]["q"],
                                  pretrained.layers.q[...])
    finetune(config, tmp_path / "run")
    assert run.main(["convert", str(tmp_path / "run"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    architecture = "XLNetForSequenceClassification"
    reference = getattr(transformers, architecture).from_pretrained(tmp_path / "hf").eval()
    ids = np.array([[10, 11, 12, 3, 2], [0, 0, 13, 3, 2]])  # A [SEP] [CLS], padded on the left
    types = np.array([[0, 0, 0, 0, 2], [4, 4, 0, 0, 2]])
    mask = np.array([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    classifier_parity(architecture).assert_parity(load_model(tmp_path / "run"), reference, ids,
                                                  types, mask)


def test_roberta_from_a_hf_folder_through_the_cli_and_back_to_hf(tmp_path, glue_folder, capsys):
    """A HF RoBERTa (`RobertaForMaskedLM` with a byte-level BPE vocab.json + merges.txt, <pad>
    at 1): fairseq's GLUE recipe and the roberta layout; `run.py finetune` learns SST-2,
    `convert --to hf` gives a `RobertaForSequenceClassification` computing our logits on
    the run's own inputs; a length beyond RoBERTa's positions is refused in one line."""
    tokenizers = pytest.importorskip("tokenizers")
    folder = tmp_path / "roberta"
    trainer = tokenizers.ByteLevelBPETokenizer()
    trainer.train_from_iterator(sentences(np.random.default_rng(1), 300)[0], vocab_size=400,
                                show_progress=False, special_tokens=[
                                    "<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    folder.mkdir()
    trainer.save_model(str(folder))
    tokenizer = load_tokenizer(folder)
    hf_reference("RobertaForMaskedLM", 0, **{**TINY, "vocab_size": tokenizer.vocab_size,
                                             "max_position_embeddings": 20,
                                             "type_vocab_size": 1}).save_pretrained(folder)
    recipe = finetune_config("sst2", str(folder), glue_folder)
    assert (recipe.model.head, recipe.examples.layout, recipe.model.position_padding_id,
            recipe.data.tokenizer) == ("roberta", "roberta", 1, str(folder))
    # fairseq README.glue.md, SST-2: lr 1e-5, batch 32, 10 epochs, 6 % warmup, fairseq's Adam
    assert (recipe.optim.learning_rate, recipe.train.batch_size, recipe.optim.weight_decay,
            recipe.optim.b2, recipe.optim.clip_norm, recipe.optim.schedule,
            recipe.model.classifier_dropout) == (1e-5, 32, 0.1, 0.98, 0.0, "linear_from_peak",
                                                 0.0)
    assert recipe.optim.eps_before_bias_correction and recipe.optim.decay_norms_and_biases
    assert (recipe.train.steps, recipe.optim.warmup_steps) == (10 * 6, 4)
    assert recipe.examples.max_seq_length == 18  # 20 positions less padding id 1 and 1
    workdir = tmp_path / "run"
    assert run.main(["finetune", "--task", "sst2", "--init", str(folder), "--data", glue_folder,
                     "--workdir", str(workdir), "--epochs", "3", *FAST,
                     "optim.learning_rate=5e-3"]) == 0
    assert json.loads((workdir / "results.json").read_text())["dev"]["accuracy"] > 0.9
    assert run.main(["convert", str(workdir), str(tmp_path / "hf"), "--to", "hf"]) == 0
    architecture = "RobertaForSequenceClassification"
    reference = getattr(transformers, architecture).from_pretrained(tmp_path / "hf").eval()
    dev = encode_glue(read_glue(glue_folder, "sst2", "dev"), tokenizer, 16, "roberta")
    classifier_parity(architecture).assert_parity(load_model(workdir), reference, *(
        dev[k][:8] for k in ("input_ids", "token_type_ids", "attention_mask")))
    capsys.readouterr()
    assert run.main(["finetune", "--task", "sst2", "--init", str(folder), "--data", glue_folder,
                     "--workdir", str(tmp_path / "long"), "examples.max_seq_length=19"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "exceeds the 18 positions" in err, err


def test_losses_equal_numpy():
    class Fixed:
        def __init__(self, logits):
            self.logits = logits
            self.config = type("C", (), {"num_labels": logits.shape[1]})

        def __call__(self, *args, rng=None):
            return self.logits

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 3)).astype(np.float32)
    labels = np.array([0, 2, 1, 1, 0, 2])
    batch = {"input_ids": None, "token_type_ids": None, "attention_mask": None, "label": labels}
    loss, metrics = classification_loss(Fixed(logits), batch, None)
    log_probs = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    np.testing.assert_allclose(loss, -log_probs[np.arange(6), labels].mean(), rtol=1e-6)
    assert float(metrics["accuracy"][0]) == np.sum(logits.argmax(1) == labels)
    scores = rng.uniform(0, 5, (6,)).astype(np.float32)
    loss, _ = classification_loss(Fixed(logits[:, :1]), {**batch, "label": scores}, None)
    np.testing.assert_allclose(loss, np.mean((logits[:, 0] - scores) ** 2), rtol=1e-6)


def test_bert_recipe_by_size():
    """BERT-Base and up: the paper's 2e-5 for 3 epochs; compact BERTs: the README's grid."""
    assert bert.glue_settings(768, "rte") == ClassifierSettings(
        learning_rate=2e-5, epochs=3, layerwise_lr_decay=1.0, weight_decay=0.01)
    assert bert.glue_settings(384, "sst2").learning_rate == 1e-4
    assert bert.glue_settings(128, "cola").epochs == 4


def test_layerwise_learning_rate_decay_scales_updates_by_depth():
    """ELECTRA optimization.py `_get_layer_lrs`: with L layers, embeddings lr x d^(L+2),
    layer i x d^(L+1-i), the task head x 1."""
    params = {"encoder": {"embeddings": {"w": np.ones((2,))},
                          "stack": {"layers": {"w": np.ones((3, 2))}}},
              "head_output": {"w": np.ones((2,))}}
    factors = layer_depth_factors(params, 0.5)
    assert float(factors["encoder"]["embeddings"]["w"]) == 0.5 ** 5
    np.testing.assert_allclose(np.ravel(factors["encoder"]["stack"]["layers"]["w"]),
                               [0.5 ** 3, 0.5 ** 2, 0.5])
    assert float(factors["head_output"]["w"]) == 1.0
    from pretext_jax.pretrain.config import OptimConfig

    sgd_like = OptimConfig(optimizer="lamb", learning_rate=0.1, warmup_steps=0,
                           schedule="constant", weight_decay=0.0, clip_norm=0.0)
    grads = jax.tree.map(np.ones_like, params)
    plain = make_optimizer(sgd_like, 10)
    decayed = make_optimizer(OptimConfig(**{**sgd_like.__dict__, "layerwise_lr_decay": 0.5}), 10)
    updates, _ = plain.update(grads, plain.init(params), params)
    scaled, _ = decayed.update(grads, decayed.init(params), params)
    ratio = jax.tree.map(lambda a, b: np.asarray(a) / np.asarray(b), scaled, updates)
    np.testing.assert_allclose(ratio["encoder"]["stack"]["layers"]["w"][:, 0],
                               [0.125, 0.25, 0.5], rtol=1e-6)
    assert isinstance(decayed, optax.GradientTransformation)


def test_glue_sweep_reports_medians_and_a_table(tmp_path, bert_dir, glue_folder):
    results = run_glue(bert_dir, glue_folder, tmp_path / "glue", tasks=["sst2", "stsb"],
                       seeds=[0, 1], overrides=[*FAST, "train.steps=1"])
    for task, metric in (("sst2", "accuracy"), ("stsb", "spearman")):
        runs = [run[metric] for run in results[task]["runs"]]
        assert len(runs) == 2 and results[task]["median"][metric] == np.median(runs)
    table = (tmp_path / "glue" / "results.md").read_text()
    again = run_glue(bert_dir, glue_folder, tmp_path / "glue", tasks=["sst2", "stsb"],
                     seeds=[0, 1], overrides=[*FAST, "train.steps=1"])
    assert again == results  # the finished sweep is read back, not retrained
    assert "| sst2 | accuracy |" in table and "| stsb | pearson |" in table
    assert json.loads((tmp_path / "glue" / "results.json").read_text())["seeds"] == [0, 1]


def test_cli_finetune_eval_and_bad_input(tmp_path, bert_dir, glue_folder, capsys):
    workdir = tmp_path / "cli"
    assert run.main(["finetune", "--task", "sst2", "--init", bert_dir, "--data", glue_folder,
                     "--workdir", str(workdir), *FAST, "train.steps=2"]) == 0
    out = capsys.readouterr().out
    trained = out[out.index("sst2 dev after 2 steps: "):].strip()
    assert re.match(r"sst2 dev after 2 steps: accuracy [0-9.]+ \(majority class [0-9.]+\), "
                    r"glue_score [0-9.]+ \(majority class [0-9.]+\)", trained), trained
    assert run.main(["eval", "--workdir", str(workdir)]) == 0
    assert capsys.readouterr().out.strip() == trained.replace("after 2 steps", "at step 2")
    before = sorted(p.name for p in workdir.rglob("*"))
    for args, fix in ((["finetune", "--task", "qqp"], "one of"),
                      (["finetune", "--task", "sst2", "--data", str(tmp_path)], "SST-2"),
                      (["eval"], "run.py finetune")):
        if args[0] == "eval":
            code = run.main([*args, "--workdir", str(tmp_path / "nothing")])
        else:
            code = run.main([*args, "--init", bert_dir, "--workdir", str(workdir),
                             *([] if "--data" in args else ["--data", glue_folder])])
        err = capsys.readouterr().err.strip()
        assert code == 2 and err.count("\n") == 0 and fix in err, err
    assert sorted(p.name for p in workdir.rglob("*")) == before


def test_cli_finetune_on_tfds_glue_by_default(tmp_path, bert_dir, capsys, monkeypatch):
    """Without --data, `finetune` reads TFDS glue/<task> prepared as ArrayRecord (in
    data.tfds_data_dir, else TFDS's default folder), as --help says; where it is not prepared,
    one line names the command that prepares it, and nothing is downloaded."""
    from tensorflow_datasets.core import constants

    with pytest.raises(SystemExit):
        run.main(["finetune", "--help"])
    assert "(default: tfds)" in " ".join(capsys.readouterr().out.split())
    rng = np.random.default_rng(0)
    splits = {}
    for split, count in (("train", 32), ("validation", 16)):
        texts, labels = sentences(rng, count)
        splits[split] = [{"sentence": t, "label": int(y)} for t, y in zip(texts, labels,
                                                                           strict=True)]
    build_glue_dataset(tmp_path / "tfds", "sst2", splits)
    assert run.main(["finetune", "--task", "sst2", "--init", bert_dir, "--workdir",
                     str(tmp_path / "w"), f"data.tfds_data_dir={tmp_path / 'tfds'}", *FAST,
                     "train.steps=2"]) == 0
    assert "\nsst2 dev after 2 steps: " in capsys.readouterr().out
    monkeypatch.setattr(constants, "DATA_DIR", str(tmp_path / "empty"))
    assert run.main(["finetune", "--task", "sst2", "--init", bert_dir, "--workdir",
                     str(tmp_path / "w2"), *FAST]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and (f"`tfds build glue/sst2 --file_format=array_record "
                                     f"--data_dir={tmp_path / 'empty'}`") in err, err
    assert not (tmp_path / "w2").exists() and not (tmp_path / "empty").exists()


def test_glue_sweep_picks_the_best_learning_rate_on_dev(tmp_path, bert_dir, glue_folder):
    results = run_glue(bert_dir, glue_folder, tmp_path / "grid", tasks=["sst2"], seeds=[0],
                       overrides=[*FAST, "train.steps=6"], learning_rates=[1e-5, 5e-3])
    scores = {rate: medians["glue_score"]
              for rate, medians in results["sst2"]["by_learning_rate"].items()}
    assert set(scores) == {"1e-05", "0.005"}
    assert f"{results['sst2']['learning_rate']:g}" == max(scores, key=scores.get)
    assert results["sst2"]["median"]["glue_score"] == max(scores.values())
    config = json.loads((tmp_path / "grid" / "sst2" / "lr0.005" / "seed0" / "config.json")
                        .read_text())
    assert config["optim"]["learning_rate"] == 5e-3


def test_pretext_model_directory_needs_and_takes_a_tokenizer(tmp_path, bert_dir, glue_folder):
    """A model directory converted from HF carries the folder's tokenizer; one without a
    tokenizer needs data.tokenizer."""
    from pretext_jax.pretrain.directories import TOKENIZER_DIR
    from pretext_jax.pretrain.export import convert

    model_dir = convert(bert_dir, tmp_path / "model", to="pretext")
    config = finetune_config("sst2", str(model_dir), glue_folder, FAST)
    assert config.data.tokenizer == str(model_dir / TOKENIZER_DIR)
    shutil.rmtree(model_dir / TOKENIZER_DIR)
    with pytest.raises(UserError, match="data.tokenizer="):
        finetune_config("sst2", str(model_dir), glue_folder, FAST)
    config = finetune_config("sst2", str(model_dir), glue_folder,
                             [*FAST, f"data.tokenizer={bert_dir}"])
    assert config.data.tokenizer == bert_dir and config.model.init == str(model_dir)


def test_majority_class_baseline_and_runs_that_end_at_it():
    """The constant predictor's GLUE metrics (checked against scikit-learn), a run no better
    than it is flagged, and the table marks cells whose every run ended there."""
    from sklearn import metrics as sk

    from pretext_jax.input_pipeline.glue import glue_task
    from pretext_jax.objectives.common.glue_metrics import constant_baseline
    from pretext_jax.pretrain.finetune import _against_baseline, glue_table

    dev = np.array([1, 1, 0, 1, 0, 1, 1])
    mrpc = constant_baseline(glue_task("mrpc"), {"0": 3, "1": 9}, dev)
    always_one = np.ones_like(dev)
    assert mrpc["accuracy"] == sk.accuracy_score(dev, always_one)
    assert mrpc["f1"] == pytest.approx(sk.f1_score(dev, always_one))
    cola = constant_baseline(glue_task("cola"), {"0": 5, "1": 2}, dev)
    assert cola == {"matthews_corrcoef": 0.0, "glue_score": 0.0}
    assert constant_baseline(glue_task("sst2"), {"0": 4, "1": 4}, dev)["accuracy"] == 2 / 7
    report = {"majority_baseline": mrpc}
    assert _against_baseline({"accuracy": 0.5, "glue_score": 0.5}, report,
                             "mrpc")["at_majority_baseline"]
    assert not _against_baseline({"f1": 0.9, "glue_score": 0.9}, report,
                                 "MRPC")["at_majority_baseline"]
    stuck = {"median": {"matthews_corrcoef": 0.0, "glue_score": 0.0}, "runs": [{}, {}],
             "majority_baseline": cola, "runs_at_majority_baseline": 2}
    learned = {**stuck, "median": {"matthews_corrcoef": 0.3, "glue_score": 0.3},
               "runs_at_majority_baseline": 1}
    table = glue_table({"a": {"cola": stuck}, "b": {"cola": learned}})
    assert "| cola | matthews_corrcoef | 0.000 (b) | 0.300 | 0.000 |" in table
    assert "ended at the majority-class baseline" in table
    assert "(b)" not in glue_table({"b": {"cola": learned}})


def test_config_file_layers_between_the_recipe_and_the_overrides(tmp_path, bert_dir, glue_folder):
    """`finetune --config FILE`: the file's settings win over the task's recipe, the command
    line's over both; a file naming a preset or method is refused (the task decides those)."""
    path = tmp_path / "experiment.yaml"
    path.write_text("optim:\n  learning_rate: 1.0e-5\n  weight_decay: 0.0\ntrain:\n"
                    "  batch_size: 8\n")
    recipe_only = finetune_config("sst2", bert_dir, glue_folder, FAST)
    config = finetune_config("sst2", bert_dir, glue_folder, [*FAST, "optim.weight_decay=0.02"],
                             config_file=path)
    assert recipe_only.optim.learning_rate != 1e-5 and config.optim.learning_rate == 1e-5
    assert config.optim.weight_decay == 0.02  # the command line over the file
    assert recipe_only.train.batch_size == 16 and config.train.batch_size == 16  # FAST wins
    assert config.optim.schedule == recipe_only.optim.schedule  # the rest is the recipe's
    path.write_text("preset: bert_tiny\n")
    with pytest.raises(UserError, match="remove preset/method"):
        finetune_config("sst2", bert_dir, glue_folder, FAST, config_file=path)


def test_downstream_tasks_are_registered_under_their_spellings():
    """`--task` finds GLUE's tasks by name or folder in any case, with the classifier's method
    and GLUE's metrics; an unknown name is a one-line error listing the tasks."""
    from pretext_jax.errors import UserError
    from pretext_jax.objectives import registry

    for name in ("sts-b", "STS_B", "stsb"):
        task = registry.downstream_task(name)
        assert (task.name, task.method, task.num_labels) == ("stsb", "classify", 1)
        assert task.metrics == ("pearson", "spearman", "glue_score")
    assert {"cola", "sst2", "mrpc", "stsb", "rte"} <= set(registry.task_names())
    with pytest.raises(UserError, match="unknown task 'squad3'; use one of .*rte"):
        registry.downstream_task("squad3")
    with pytest.raises(ValueError, match="already registered"):
        registry.register_task(dataclasses.replace(task, name="x", aliases=("STS-B",)))
