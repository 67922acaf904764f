"""Transfer in stages (`pretrain.transfer`): within-task continued pre-training then fine-tuning
(Gururangan et al. 2020; Sun et al. 2019 §5.1), and MT-DNN's multi-task training (Liu et al.
2019, `objectives.mtdnn`) with its task sampler (`input_pipeline.multitask`)."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity_utils import hf_reference
from resilience_utils import (
    GRADIENT_STEP,
    TINY_BERT,
    assert_same_step_on_every_mesh,
    flat_params,
    mesh_overrides,
    small_corpus,
    train_losses,
)
from text_utils import labelled_sentences, write_glue_folder

from pretext_jax import (
    objectives,  # noqa: F401  (registers the methods)
    run,
)
from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.glue import read_glue
from pretext_jax.input_pipeline.multitask import MultiTaskBatches
from pretext_jax.models.classifier import MultiHeadClassifier
from pretext_jax.objectives.classification import pretrained_classifier
from pretext_jax.objectives.mtdnn import MultiTaskModelConfig, multitask_loss
from pretext_jax.pretrain import transfer
from pretext_jax.pretrain.config import config_from_dict, make_config
from pretext_jax.pretrain.directories import CONFIG_FILE, read_json_object
from pretext_jax.pretrain.finetune import finetune_config
from pretext_jax.pretrain.loading import load_model, load_pretrained
from pretext_jax.pretrain.trainer import Trainer

WORDS = ["good", "bad", "movie", "film", "plot", "actors", "the", "a", "was", "is", "very",
         "story", "music"]
TUNING = ["examples.max_seq_length=32", "train.batch_size=16", "train.progress=false",
          "train.checkpoint_every=2", "optim.learning_rate=1e-3"]
CONTINUE_STEPS = 8
# The checkpoint's run: 8 steps at 3e-3 warmed up over 1, so that the continued run (8 steps,
# warmup 6 % -> 1, the checkpoint's rate) is the same compiled program.
PRETRAINING = {**TINY_BERT, "train.steps": CONTINUE_STEPS, "optim.learning_rate": 3e-3,
               "optim.warmup_steps": 1, "train.checkpoint_every": CONTINUE_STEPS}
STAGE = ["continue.train.checkpoint_every=3"]


class Killed(Exception):
    """Raised in place of a step, as a kill stops a run."""


def sentences(rng: np.random.Generator, count: int) -> tuple[list[str], np.ndarray]:
    return labelled_sentences(rng, count, WORDS)


@pytest.fixture(scope="module")
def glue_folder(tmp_path_factory):
    """SST-2 (80 train rows) and STS-B (40) in GLUE's file layout."""
    return write_glue_folder(tmp_path_factory.mktemp("glue"), WORDS, (80, 32), (40, 16))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A one-layer BERT pre-trained for 8 steps (MLM + NSP) on a small corpus."""
    root = tmp_path_factory.mktemp("bert")
    Trainer(make_config("bert_tiny", {**PRETRAINING, **small_corpus(root)}), root / "w").run()
    return str(root / "w")


def killing(monkeypatch, stage: str, step: int) -> None:
    """Trainers in a folder named `stage` raise `Killed` in place of `step`."""
    original = Trainer.train_step

    def train_step(self, state, batch):
        if self.workdir.name == stage and int(jax.device_get(state.step)) + 1 == step:
            raise Killed(f"{stage} step {step}")
        return original(self, state, batch)

    monkeypatch.setattr(Trainer, "train_step", train_step)


def encoder_params(path: str) -> dict[str, np.ndarray]:
    model = load_model(path, downstream=True)
    return flat_params(nnx.state(model.encoder, nnx.Param))


def test_two_stage_trains_on_the_task_text_then_fine_tunes_and_resumes_in_each_stage(
        tmp_path, checkpoint, glue_folder, monkeypatch):
    """The first stage continues the checkpoint's own MLM + NSP on the task's training
    sentences (its loss falls; the encoder moves); the second fine-tunes from its result (its
    `model.init`), not from the original. A run killed in stage 1, then in stage 2, ends bit for
    bit as an uninterrupted one (the control: its stage-1 encoder differs from the original)."""
    def run(workdir):
        return transfer.run_two_stage("sst2", checkpoint, glue_folder, workdir, CONTINUE_STEPS,
                                      [*STAGE, *TUNING], epochs=1.0)

    reference = tmp_path / "reference"
    result = run(reference)
    first, second = reference / transfer.CONTINUE, reference / transfer.FINETUNE
    corpus = (first / transfer.CORPUS_FILE).read_text().split("\n\n")
    assert [line.strip() for line in corpus] == read_glue(glue_folder, "sst2", "train").texts_a
    saved = config_from_dict(read_json_object(first / CONFIG_FILE))
    assert (saved.method, saved.train.steps, saved.data.source) == (
        "bert", CONTINUE_STEPS, str(first / transfer.CORPUS_FILE))
    losses = train_losses(first)
    assert sorted(losses) == list(range(1, CONTINUE_STEPS + 1))
    assert np.mean([losses[7], losses[8]]) < losses[1] - 0.3, losses
    tuned = config_from_dict(read_json_object(second / CONFIG_FILE))
    assert (tuned.method, tuned.model.init) == ("classify", str(first))
    continued, original = encoder_params(str(first)), encoder_params(checkpoint)
    assert max(np.abs(continued[k] - original[k]).max() for k in original) > 1e-3
    assert result["steps"] == 5 and result["continue_steps"] == CONTINUE_STEPS

    ours = tmp_path / "ours"
    for stage, step in ((transfer.CONTINUE, 5), (transfer.FINETUNE, 4)):
        with monkeypatch.context() as patch:
            killing(patch, stage, step)
            with pytest.raises(Killed):
                run(ours)
    assert run(ours)["dev"] == result["dev"]
    for folder in (transfer.CONTINUE, transfer.FINETUNE):
        assert train_losses(ours / folder) == train_losses(reference / folder)
        mine, theirs = (flat_params(nnx.state(load_model(str(root / folder)), nnx.Param))
                        for root in (ours, reference))
        assert all(np.array_equal(mine[k], theirs[k]) for k in theirs), folder

    # refusals, each before anything is written
    with pytest.raises(UserError, match="holds another transfer run"):
        transfer.run_two_stage("sst2", checkpoint, glue_folder, ours, 3, TUNING)
    with pytest.raises(UserError, match="fine-tuning run"):
        transfer.run_two_stage("sst2", str(second), glue_folder, tmp_path / "new", 3, TUNING)
    with pytest.raises(UserError, match="has no config.json"):
        transfer.run_two_stage("sst2", glue_folder, glue_folder, tmp_path / "new", 3, TUNING)
    assert not (tmp_path / "new").exists()


def hf_bert(path, architecture: str) -> str:
    """A random one-layer HF BERT of `architecture` with a vocab of WORDS."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    hf_reference(architecture, 0, vocab_size=len(vocab), hidden_size=32, num_hidden_layers=1,
                 num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                 num_labels=2).save_pretrained(path)
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    return str(path)


def test_two_stage_continues_a_huggingface_checkpoint(tmp_path, glue_folder):
    """TAPT from a HF BERT (as Gururangan et al. continue roberta-base): the continued stage is
    the `bert` method at its defaults with the checkpoint's architecture and tokenizer, it
    starts from the checkpoint's weights (heads included), and its result is fine-tuned. A
    bare `BertModel` continues with new heads; a fine-tuned classifier is refused."""
    pytest.importorskip("transformers")
    from pretext_jax.pretrain import hf

    init = hf_bert(tmp_path / "hf", "BertForPreTraining")
    result = transfer.run_two_stage("sst2", init, glue_folder, tmp_path / "w", 2,
                                    ["continue.train.batch_size=16",
                                     "continue.examples.max_seq_length=32", *TUNING], epochs=0.5)
    first = tmp_path / "w" / transfer.CONTINUE
    saved = config_from_dict(read_json_object(first / CONFIG_FILE))
    default = make_config(None, ["method=bert"])
    assert (saved.method, saved.model.hidden_size, saved.model.num_layers) == ("bert", 32, 1)
    assert (saved.optim.learning_rate, saved.data.tokenizer) == (default.optim.learning_rate, init)
    assert result["continued_from"] == init and result["steps"] == 3
    # The stage's start is the checkpoint (its MLM and NSP heads too); a fresh network differs.
    trainer = transfer.ContinuedPretraining(saved, tmp_path / "start", init)
    start = flat_params(nnx.state(trainer.model_of(trainer.init_state()), nnx.Param))
    checkpoint = flat_params(nnx.state(hf.load(init), nnx.Param))
    assert start.keys() == checkpoint.keys()
    assert all(np.array_equal(start[k], checkpoint[k]) for k in checkpoint)
    fresh = flat_params(Trainer(saved, tmp_path / "fresh").init_state().params)
    assert any(not np.array_equal(fresh[k], checkpoint[k]) for k in checkpoint)

    bare = hf_bert(tmp_path / "bare", "BertModel")
    with pytest.warns(UserWarning, match="keep their initial values"):
        settings = transfer.hf_pretraining_settings(bare)
    assert "method=bert" in settings and "model.hidden_size=32" in settings
    tuned = hf_bert(tmp_path / "tuned", "BertForSequenceClassification")
    with pytest.raises(UserError, match="which no pre-training method continues"):
        transfer.run_two_stage("sst2", tuned, glue_folder, tmp_path / "new", 2, TUNING)
    assert not (tmp_path / "new").exists()


def test_task_text_is_the_rows_the_run_reads_without_labels(tmp_path, glue_folder):
    """TAPT's corpus (`DownstreamTask.train_text`): GLUE rows and CoNLL sentences (words joined
    by spaces), one document each, as many as `examples.max_train_examples` lets the run read;
    a task without text is refused before anything is written."""
    from types import SimpleNamespace

    from pretext_jax.objectives import registry

    def run_of(rows: int) -> SimpleNamespace:
        return SimpleNamespace(examples=SimpleNamespace(max_train_examples=rows),
                               data=SimpleNamespace(tfds_data_dir=""))

    sentences = read_glue(glue_folder, "sst2", "train").texts_a
    sst2 = registry.downstream_task("sst2")
    assert transfer.task_text(sst2, glue_folder, run_of(0)) == "\n\n".join(sentences) + "\n"
    assert transfer.task_text(sst2, glue_folder, run_of(3)) == "\n\n".join(sentences[:3]) + "\n"
    train = tmp_path / "train.conll"
    train.write_text("Paris B-loc\nis O\nbig O\n\nAnna B-person\nsings O\n\nok O\n")
    ner = registry.downstream_task("wnut17")
    assert transfer.task_text(ner, str(train), run_of(2)) == "Paris is big\n\nAnna sings\n"
    squad = registry.downstream_task("squad")
    assert squad.train_text is None
    with pytest.raises(UserError, match="squad does not give"):
        transfer.run_two_stage("squad", str(tmp_path), str(tmp_path), tmp_path / "new", 2)
    assert not (tmp_path / "new").exists()


class Rows:
    """A stand-in for a `RecordDirectory` of `count` records, record i holding i."""

    def __init__(self, count: int):
        self.source = [i for i in range(count)]

    def written_order(self) -> np.ndarray:
        return np.arange(len(self.source))


def test_mtdnn_sampler_draws_tasks_in_proportion_to_their_size():
    """Algorithm 1 / `MultiTaskBatchSampler`: an epoch holds each task's ceil(n_t / B) batches
    once, each batch one task's consecutive rows (the last filled from the task's first), in an
    order shuffled per epoch: over many epochs the task at any one position comes up in
    proportion to the tasks' batch counts, and a schedule read again gives the same records."""
    sizes, batch = (70, 20, 45), 8
    counts = np.array([math.ceil(n / batch) for n in sizes])  # 9, 3, 6 batches
    schedule = MultiTaskBatches(Rows(sum(sizes)), sizes, seed=3, batch_size=batch)
    steps = counts.sum()
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    epochs = 3000
    first = np.zeros(len(sizes))
    for epoch in range(epochs):
        order = schedule.epoch(epoch)
        assert sorted(map(tuple, order.tolist())) == sorted(
            (t, b) for t, c in enumerate(counts) for b in range(c))
        first[order[0, 0]] += 1
    expected = counts / steps
    sigma = np.sqrt(expected * (1 - expected) / epochs)
    assert np.all(np.abs(first / epochs - expected) < 4 * sigma), (first / epochs, expected)
    # an epoch's records: every row of every task, a step's rows from one task
    seen = {task: [] for task in range(len(sizes))}
    for step in range(steps):
        rows = [schedule[step * batch + r] for r in range(batch)]
        task = int(np.searchsorted(offsets, rows[0], side="right") - 1)
        assert all(offsets[task] <= r < offsets[task] + sizes[task] for r in rows)
        seen[task] += rows
    for task, rows in seen.items():
        assert sorted(set(rows)) == list(range(offsets[task], offsets[task] + sizes[task]))
        assert len(rows) == counts[task] * batch
    again = MultiTaskBatches(Rows(sum(sizes)), sizes, seed=3, batch_size=batch)
    assert [again[k] for k in range(500)] == [schedule[k] for k in range(500)]
    other = MultiTaskBatches(Rows(sum(sizes)), sizes, seed=4, batch_size=batch)
    assert [other[k] for k in range(500)] != [schedule[k] for k in range(500)]


def tiny_multitask() -> MultiHeadClassifier:
    config = MultiTaskModelConfig(vocab_size=20, hidden_size=16, num_layers=1, num_heads=2,
                                  intermediate_size=32, max_position_embeddings=16,
                                  task_labels=(3, 1, 2))
    return MultiHeadClassifier(config, rngs=nnx.Rngs(0))


def test_mtdnn_loss_matches_numpy_and_a_task_trains_only_its_own_layer():
    """Cross-entropy for classification tasks, squared error for the regression (MT-DNN
    §3.1), each row under its task's layer, averaged over the batch: against a numpy
    re-statement on a batch of mixed tasks. A batch of one task gives a gradient to the
    shared encoder and pooler and to that task's layer only (the control: another task's
    batch moves the other layer)."""
    model = tiny_multitask()
    rng = np.random.default_rng(0)
    ids = rng.integers(5, 20, (6, 8)).astype(np.int32)
    batch = {"input_ids": ids, "token_type_ids": np.zeros_like(ids),
             "attention_mask": np.ones_like(ids), "task": np.array([0, 1, 2, 0, 1, 2], np.int32),
             "label": np.array([2, 3.5, 1, 0, 0.25, 0], np.float32)}
    graph, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def loss_of(params, batch):  # compiled once: every batch below has 2 or 6 rows
        return multitask_loss(nnx.merge(graph, params, rest), batch, None)

    loss, metrics = loss_of(params, batch)
    logits = np.asarray(nnx.jit(lambda m: m(ids, batch["token_type_ids"],
                                            batch["attention_mask"]))(model))
    expected = []
    for row, (task, label) in enumerate(zip(batch["task"], batch["label"], strict=True)):
        out = logits[row, task, :(3, 1, 2)[task]].astype(np.float64)
        if task == 1:
            expected.append((out[0] - label) ** 2)
        else:
            expected.append(np.log(np.exp(out).sum()) - out[int(label)])
    np.testing.assert_allclose(float(loss), np.mean(expected), rtol=1e-5)
    assert float(metrics["accuracy"][1]) == 4

    gradient = jax.jit(jax.grad(lambda params, batch: loss_of(params, batch)[0]))

    def grads(task: int) -> dict[str, np.ndarray]:
        rows = batch["task"] == task
        return flat_params(gradient(params, {k: jnp.asarray(v[rows]) for k, v in batch.items()}))

    for task in range(3):
        grad = grads(task)
        moved = {k for k, v in grad.items() if np.abs(v).max() > 0}
        outputs = {k for k in grad if "task_outputs" in k}
        mine = {k for k in outputs if f"[{task}]" in k}
        assert moved & outputs == mine and mine
        assert any("encoder" in k for k in moved) and any("head_dense" in k for k in moved)


def test_mtdnn_step_is_the_same_on_every_mesh_and_per_task_fine_tuning_starts_from_it(
        tmp_path, checkpoint, glue_folder, monkeypatch):
    """One MT-DNN step on one device and on the (2, 2, 2) mesh agree and read one task's rows;
    a short MT-DNN run reports every task's dev metrics, and each task's fine-tuning starts
    from its encoder and shared pooler under a fresh output layer."""
    tasks = ["sst2", "stsb"]

    def overrides(mesh):
        return [*TUNING, *(f"{k}={v}" for k, v in {**GRADIENT_STEP,
                                                   **mesh_overrides(mesh)}.items())]

    def trainer_at(workdir, mesh, devices):
        config = transfer.multitask_config(tasks, checkpoint, glue_folder, overrides(mesh))
        return Trainer(config, workdir, devices=devices)

    batch = assert_same_step_on_every_mesh(trainer_at, tmp_path)
    assert len(set(batch["task"].tolist())) == 1  # one task per batch

    tuned = []
    monkeypatch.setattr(transfer, "finetune", lambda config, workdir: tuned.append(
        (config.examples.task, config.model.init, workdir.name, config.train.batch_size))
        or {"task": tuned[-1][0]})

    def run(root):
        return transfer.run_multitask(tasks, checkpoint, glue_folder, root,
                                      [*overrides((2, 2, 2)), "each.train.batch_size=8"],
                                      epochs=0.5, finetune_each=True)

    root = tmp_path / "mt"
    result = run(root)
    assert result["steps"] == 4  # half an epoch of 5 + 3 batches
    assert {"sst2_accuracy", "stsb_pearson", "stsb_spearman", "stsb_glue_score",
            "glue_score"} <= set(result["multitask"])
    multitask = str(root / transfer.MULTITASK)
    assert tuned == [(task, multitask, task, 8) for task in tasks]
    assert json.loads((root / "results.json").read_text())["tasks"] == tasks
    # killed after its checkpoint at step 2, then run again: the same schedule and parameters
    with monkeypatch.context() as patch:
        killing(patch, transfer.MULTITASK, 3)
        with pytest.raises(Killed):
            run(tmp_path / "again")
    assert run(tmp_path / "again")["multitask"] == result["multitask"]
    mine, theirs = (flat_params(nnx.state(load_model(str(r / transfer.MULTITASK)), nnx.Param))
                    for r in (tmp_path / "again", root))
    assert all(np.array_equal(mine[k], theirs[k]) for k in theirs)
    assert train_losses(tmp_path / "again" / transfer.MULTITASK) == train_losses(
        root / transfer.MULTITASK)

    shared = load_model(multitask)
    assert shared.config.task_labels == (2, 1)
    config = finetune_config("stsb", multitask, glue_folder, TUNING)
    assert config.method == "classify" and config.model.num_labels == 1
    start = pretrained_classifier(config.model, 0, load_pretrained)
    for part in ("encoder", "head_dense"):
        mine, theirs = (flat_params(nnx.state(getattr(m, part), nnx.Param))
                        for m in (start, shared))
        assert all(np.array_equal(mine[k], theirs[k]) for k in theirs), part


def test_cli_refusals(tmp_path, glue_folder, capsys):
    """`run.py finetune`'s stage options refuse what they cannot do, before anything is
    written."""
    common = ["finetune", "--data", glue_folder, "--workdir", str(tmp_path / "w")]
    for options, message in (
            (["--task", "sst2", "--finetune-each", "--init", glue_folder], "several --task"),
            (["--task", "sst2,stsb", "--continue-steps", "3", "--init", glue_folder],
             "drop --continue-steps"),
            (["--task", "sst2", "--continue-steps", "3", "--architecture", glue_folder],
             "give it as --init")):
        assert run.main([*common, *options]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "w").exists()
