"""TinyBERT (Jiao et al. 2020 §3.1-3.2). General distillation: the encoder's per-layer trace
(hidden states, attention scores) against numpy, the layer map and each loss term against a
numpy re-statement of general_distill.py (the W projections, the -10000 / <= -100 handling of
masked scores, MSE means summed over layers), the gradient reaching the student and the
projections only, a frozen teacher (not a parameter, no optimizer state, unchanged by
training), a killed run's exact resume, a sharded step equal to the single-device one, the
student's HF export, and bad teachers and settings refused in one line. Task distillation:
task_distill.py's soft cross-entropy (mean over batch and classes at t) and both stages'
losses re-stated in numpy on the classifiers' outputs, a run on a GLUE folder with the
fine-tuned teacher frozen, and its refusals."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity_utils import hf_reference, random_model
from resilience_utils import (
    GRADIENT_STEP,
    abort_and_resume,
    assert_same_step_on_every_mesh,
    assert_same_training,
    flat_params,
    mesh_overrides,
    run_in_process,
    small_corpus,
    train_losses,
)

from pretext_jax.errors import UserError
from pretext_jax.models.distilbert import DistilBert, DistilBertConfig
from pretext_jax.models.layers import Frozen
from pretext_jax.models.tinybert import TinyBert, TinyBertConfig, TinyBertTask, TinyBertTaskConfig
from pretext_jax.objectives.tinybert import (
    TaskDistillationSettings,
    attention_score_loss,
    general_distillation_loss,
    layer_map,
    prepare_task,
    pretrained_tinybert,
    pretrained_tinybert_task,
    soft_cross_entropy,
    student_glue_metrics,
    task_distillation_loss,
)
from pretext_jax.pretrain import hf
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.loading import load_pretrained
from pretext_jax.pretrain.trainer import Trainer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


# --- numpy re-statements of general_distill.py ----------------------------------------------

def np_mse(a, b):
    """torch `MSELoss()`: the mean over every element."""
    return np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)


def np_general_loss(student_atts, teacher_atts, student_reps, teacher_reps, mask):
    """general_distill.py's loop over lists (scores [B, N, T, T] with modeling.py's -10000 at
    padded keys already added; reps already through fit_dense): att_loss, rep_loss."""
    per_block = len(teacher_atts) // len(student_atts)
    new_teacher_atts = [teacher_atts[i * per_block + per_block - 1]
                        for i in range(len(student_atts))]
    att = 0.0
    for s, t in zip(student_atts, new_teacher_atts, strict=True):
        att += np_mse(np.where(s <= -100, 0, s), np.where(t <= -100, 0, t))
    new_teacher_reps = [teacher_reps[i * per_block] for i in range(len(student_atts) + 1)]
    rep = sum(np_mse(s, t) for s, t in zip(student_reps, new_teacher_reps, strict=True))
    return att, rep


def np_scores(layer, x, num_heads):
    """modeling.py `BertSelfAttention`: q.k / sqrt(D) of one layer's input `x` [B, T, H]."""
    def heads(name):
        y = (np.asarray(x, np.float64) @ np.asarray(layer[name]["kernel"], np.float64)
             + layer[name]["bias"])
        return y.reshape(*x.shape[:2], num_heads, -1)
    q, k = heads("query"), heads("key")
    return np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])


def layer_at(stack, index):
    """Layer `index` of stacked `layers` as a dict of arrays by sub-module name."""
    return {name: {p: getattr(getattr(stack.layers, name), p)[...][index]
                   for p in ("kernel", "bias")} for name in ("query", "key")}


TINY = TinyBertConfig(vocab_size=30, hidden_size=8, num_layers=2, num_heads=2,
                      intermediate_size=12, max_position_embeddings=16, teacher_hidden_size=12,
                      teacher_num_layers=4, teacher_intermediate_size=16,
                      teacher_max_position_embeddings=16, hidden_dropout=0.0,
                      attention_dropout=0.0)


def test_layer_map_and_the_masked_score_rule():
    """g(m) = m N / M with the embeddings 0 -> 0; attention scores at padded keys or <= -100
    count as 0 in both networks (a padded query's row still counts)."""
    assert layer_map(2, 4) == (0, 2, 4)
    assert layer_map(4, 12) == (0, 3, 6, 9, 12)
    assert layer_map(3, 3) == (0, 1, 2, 3)
    rng = np.random.default_rng(0)
    s, t = rng.normal(size=(2, 1, 2, 2, 4, 4)) * 3
    s[0, 0, 0, 1, 2] = -150.0  # a genuine score below the floor: 0, as the authors' code
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]])
    additive = (1 - mask)[None, :, None, None, :] * -10000.0  # modeling.py's extended mask
    expected, _ = np_general_loss(list(s + additive), list(t + additive), [0, 0], [0, 0],
                                  mask)
    got = float(attention_score_loss(jnp.asarray(s), jnp.asarray(t), jnp.asarray(mask)))
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    # Control: without the zeroing the padded keys' scores would count.
    assert abs(got - np_mse(s, t)) > 0.1


def test_the_loss_against_general_distill_on_the_networks_outputs():
    """The traced hidden states and scores are the encoder's (last state = its output, scores =
    q.k / sqrt(D) of each layer's input); the loss is att_loss + rep_loss of general_distill.py
    re-stated in numpy on them, with W_h = fit.dense for the layers' states and W_e =
    fit.embeddings for the embeddings (§3.1 Eq. 10; the authors' single fit_dense for both,
    the default, is the run's below); the gradient reaches the student and both projections,
    never the teacher."""
    model = random_model(TinyBert, dataclasses.replace(TINY, shared_projection=False), 0)
    rng = np.random.default_rng(1)
    for _, variable in nnx.to_flat_state(nnx.state(model, Frozen)):
        shape = variable.get_value().shape  # a teacher unlike the student
        variable.set_value(jnp.asarray(0.3 * rng.standard_normal(shape), jnp.float32))
    mask = np.ones((2, 7), np.int32)
    mask[1, 4:] = 0
    batch = {"input_ids": jnp.asarray(rng.integers(0, 30, (2, 7))),
             "segment_ids": jnp.asarray(np.array([[0, 0, 0, 1, 1, 1, 1]] * 2)),
             "input_mask": jnp.asarray(mask)}

    inputs = (batch["input_ids"], batch["segment_ids"], batch["input_mask"])

    @nnx.jit
    def everything(model):
        """The loss, the outputs, the encoders' plain outputs, the student's states before
        the projection and the gradient, in one compiled program."""
        out = model(*inputs)
        ends = model.student.encoder(*inputs), model.teacher(*inputs)
        raw = model.student.encoder.embed(*inputs[:2], None)
        states = model.student.encoder.stack.trace(
            raw, inputs[2].astype(bool)[:, None, None, :], None)[0]
        grads = nnx.grad(lambda m: general_distillation_loss(m, batch, None)[0])(model)
        return general_distillation_loss(model, batch, None), out, ends, raw, states, grads

    (loss, metrics), out, ends, raw, states, grads = everything(model)
    np.testing.assert_allclose(states[-1], ends[0], atol=1e-6)
    np.testing.assert_allclose(out.teacher_states[-1], ends[1], atol=1e-6)
    # the scores of student and teacher layers against numpy from their inputs
    student = [np.asarray(raw), *np.asarray(states)]
    for index in range(2):
        np.testing.assert_allclose(
            out.student_scores[index],
            np_scores(layer_at(model.student.encoder.stack, index), student[index], 2),
            rtol=1e-4, atol=1e-5)
    teacher_all = np.asarray(out.teacher_states)
    for index in range(4):
        np.testing.assert_allclose(
            out.teacher_scores[index],
            np_scores(layer_at(model.teacher.stack, index), teacher_all[index], 2),
            rtol=1e-4, atol=1e-4)
    # the projections: W (and b) of fit_dense on every state, or fit_embeddings on state 0
    def project(layer, x):
        return x @ np.asarray(layer.kernel[...], np.float64) + np.asarray(layer.bias[...])
    projected = [project(model.fit.embeddings, student[0]),
                 *(project(model.fit.dense, x) for x in student[1:])]
    np.testing.assert_allclose(np.asarray(out.student_states), projected, rtol=1e-4, atol=1e-5)
    # the loss: general_distill.py on the lists, modeling.py's -10000 at padded keys added
    additive = (1 - mask)[:, None, None, :] * -10000.0
    att, rep = np_general_loss(list(np.asarray(out.student_scores) + additive),
                               list(np.asarray(out.teacher_scores) + additive), projected,
                               list(teacher_all), mask)
    assert min(att, rep) > 0.01
    np.testing.assert_allclose(float(metrics["att_loss"][0]), att, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["rep_loss"][0]), rep, rtol=1e-5)
    np.testing.assert_allclose(float(loss), att + rep, rtol=1e-5)
    assert "teacher" not in grads
    assert float(jnp.abs(grads["fit"]["dense"]["kernel"][...]).sum()) > 0
    assert float(jnp.abs(grads["fit"]["embeddings"]["kernel"][...]).sum()) > 0
    assert float(jnp.abs(grads["student"]["encoder"]["stack"]["layers"]["query"]["kernel"][...]
                         ).sum()) > 0


# --- a run with a teacher ---------------------------------------------------------------------

WORDS = ["sentence", "talks", "about", "topic", "and", "then", "some", "more", "words", "."]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *map(str, range(10)),
         *(f"##{d}" for d in range(10))]


def hf_teacher(folder, architecture="BertModel"):
    """A random HF BERT of 2 layers of 32 with 2 heads, saved with `VOCAB`'s WordPieces."""
    model = hf_reference(architecture, 0, vocab_size=len(VOCAB), hidden_size=32,
                         num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
                         max_position_embeddings=64)
    model.save_pretrained(folder)
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    return folder


def run_overrides(root, teacher, **extra):
    return {**small_corpus(root), "data.tokenizer": str(teacher / "vocab.txt"),
            "model.teacher": str(teacher), "model.hidden_size": 16, "model.num_heads": 2,
            "model.intermediate_size": 24, "model.max_position_embeddings": 32,
            "model.teacher_hidden_size": 32, "model.teacher_intermediate_size": 48,
            "model.teacher_max_position_embeddings": 64, "examples.max_seq_length": 24,
            "train.batch_size": 8, "train.steps": 3, "train.log_every": 1,
            "train.eval_every": 1000, "train.eval_batches": 1, "train.checkpoint_every": 2,
            "train.progress": False, **extra}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    torch.manual_seed(0)
    return hf_teacher(tmp_path_factory.mktemp("teacher"))


def test_teacher_stays_frozen_and_a_killed_run_resumes_exactly(teacher, tmp_path):
    """A run killed in place of step 3 and resumed ends bit for bit as an uninterrupted one.
    At its end the teacher's encoder weights are `Frozen` model state still equal to the HF
    model's, never parameters or optimizer state, while the student (one projection,
    `fit.dense`) trained: the loss moved; its downstream model is the student BERT, which HF
    reads back."""
    values = run_overrides(tmp_path, teacher)
    reference = tmp_path / "reference", tmp_path / "reference.log"
    run_in_process("tinybert_tiny", values, *reference)
    ours = abort_and_resume("tinybert_tiny", values, tmp_path, step=3)
    assert len(assert_same_training("tinybert_tiny", values, ours, reference)) > 3
    assert len(set(train_losses(ours[0]).values())) == 3
    end = Trainer(make_config("tinybert_tiny", values), ours[0])
    final, _ = end.checkpoints.restore_latest_readable()
    end.checkpoints.close()
    moved = flat_params(final.params)
    assert not any("teacher" in k for k in moved)
    assert {k for k in moved if "['fit']['dense']" in k} and not any(
        "['fit']['embeddings']" in k for k in moved)
    assert not any("teacher" in str(path) for path, _ in
                   jax.tree_util.tree_leaves_with_path(final.opt_state))
    theirs = flat_params(nnx.state(load_pretrained(teacher).encoder, nnx.Param))
    frozen = flat_params(final.model_state)
    assert len(frozen) == len(theirs)
    for key, value in frozen.items():
        np.testing.assert_array_equal(value, theirs[key.replace("['teacher']", "")])
    assert all(isinstance(v, Frozen) for v in jax.tree.leaves(
        nnx.state(end.model_of(final).teacher), is_leaf=lambda x: isinstance(x, nnx.Variable)))
    word = "['student']['encoder']['embeddings']['word_embeddings']['embedding'].value"
    assert moved[word].shape == (len(VOCAB), 16)  # the student's own
    student = load_pretrained(ours[0])
    assert type(student).__name__ == "Bert" and student.config.hidden_size == 16
    hf.save(student, tmp_path / "export")
    exported = transformers.BertForPreTraining.from_pretrained(tmp_path / "export")
    np.testing.assert_allclose(
        exported.bert.embeddings.word_embeddings.weight.detach().numpy(),
        moved[word], rtol=1e-6)


def test_sharded_step_equals_single_device_step(teacher, tmp_path):
    """One step on the (2, 2, 2) mesh equals the single-device step; the teacher's weights are
    placed by the same logical names as the student's."""
    def trainer_at(workdir, mesh, devices):
        values = run_overrides(tmp_path, teacher, **GRADIENT_STEP, **mesh_overrides(mesh))
        trainer = Trainer(make_config("tinybert_tiny", values), workdir, devices=devices)
        student = trainer.state_sharding.params["student"]["encoder"]
        frozen = trainer.state_sharding.model_state["teacher"]
        for name in ("stack", "layers", "intermediate", "kernel"):
            student, frozen = student[name], frozen[name]
        assert student.spec == frozen.spec and (mesh == (1, 1, 1) or any(student.spec))
        return trainer

    assert assert_same_step_on_every_mesh(trainer_at, tmp_path)["input_ids"].shape == (8, 24)


def test_bad_teachers_and_settings_are_refused_in_one_line(teacher, tmp_path):
    config = dataclasses.replace(
        make_config("tinybert_tiny", run_overrides(tmp_path, teacher)).model,
        vocab_size=len(VOCAB))

    def refusal(path=teacher, **fields):
        with pytest.raises(UserError) as error:
            pretrained_tinybert(dataclasses.replace(config, teacher=str(path), **fields), 0,
                                load_pretrained)
        assert "\n" not in str(error.value)
        return str(error.value)

    assert "model.teacher is empty" in refusal(path="")
    assert "not a directory" in refusal(path=tmp_path / "absent")
    assert "set model.num_heads=2" in refusal(num_heads=4)
    assert "data.tokenizer=" in refusal(vocab_size=40)
    assert "set model.teacher_hidden_size=32 model.teacher_num_layers=2" in refusal(
        teacher_hidden_size=64, teacher_num_layers=4)
    distil = tmp_path / "distilbert"  # a teacher of another family
    hf.save(random_model(DistilBert, DistilBertConfig(
        vocab_size=len(VOCAB), hidden_size=32, num_layers=2, num_heads=2, intermediate_size=8,
        max_position_embeddings=64), 0), distil)
    assert "not a BERT" in refusal(path=distil)
    with pytest.raises((UserError, ValueError), match="multiple of num_layers"):
        make_config("tinybert_tiny", {"model.num_layers": 3})
    with pytest.raises(UserError, match="position embeddings"):
        make_config("tinybert_tiny", {"examples.max_seq_length": 512})
    with pytest.raises(UserError, match="read every student layer.*set model.layerdrop=0"):
        make_config("tinybert_tiny", {"model.layerdrop": 0.2})


# --- task distillation -----------------------------------------------------------------------

def np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def np_soft_cross_entropy(s, t, temperature):
    """task_distill.py `soft_cross_entropy(s / T, t / T)`: (-softmax(t/T) log_softmax(s/T))
    .mean() over batch and classes."""
    return np.mean(-np.exp(np_log_softmax(t / temperature)) * np_log_softmax(s / temperature))


TASK = TinyBertTaskConfig(vocab_size=30, hidden_size=8, num_layers=1, num_heads=2,
                          intermediate_size=12, max_position_embeddings=16,
                          teacher_hidden_size=12, teacher_num_layers=2,
                          teacher_intermediate_size=16, teacher_max_position_embeddings=16,
                          hidden_dropout=0.0, attention_dropout=0.0, num_labels=3)


def test_task_stages_against_task_distill():
    """The intermediate stage is general_distill.py's loss on the two classifiers' encoders;
    the prediction stage task_distill.py's soft cross-entropy of the student's logits (its own
    classifier's) against the teacher's at t (a mean over the classes too: 1 / C of the
    per-example cross-entropy), its gradient reaching the student's head and not the unused
    projection; with one output (STS-B) the mean squared error to the gold score."""
    rng = np.random.default_rng(2)
    s, t = rng.normal(size=(2, 5, 3)) * 2
    for temperature in (1.0, 2.0):
        np.testing.assert_allclose(
            float(soft_cross_entropy(jnp.asarray(s), jnp.asarray(t), temperature)),
            np_soft_cross_entropy(s, t, temperature), rtol=1e-6)
    per_example = torch.nn.functional.cross_entropy(torch.as_tensor(s), torch.softmax(
        torch.as_tensor(t), -1))  # torch's soft-label cross-entropy, a mean over examples
    np.testing.assert_allclose(np_soft_cross_entropy(s, t, 1.0), per_example.item() / 3)

    models = [random_model(TinyBertTask, config, 0)
              for config in (TASK, dataclasses.replace(TASK, num_labels=1))]
    for model in models:
        for _, variable in nnx.to_flat_state(nnx.state(model, Frozen)):
            shape = variable.get_value().shape
            variable.set_value(jnp.asarray(0.3 * rng.standard_normal(shape), jnp.float32))
    mask = np.ones((4, 6), np.int32)
    mask[2, 3:] = 0
    batch = {"input_ids": jnp.asarray(rng.integers(0, 30, (4, 6))),
             "token_type_ids": jnp.zeros((4, 6), jnp.int32), "attention_mask": jnp.asarray(mask),
             "label": jnp.asarray([0, 2, 1, 2])}
    inputs = batch["input_ids"], batch["token_type_ids"], batch["attention_mask"]
    first, second = (TaskDistillationSettings(stage=stage)
                     for stage in ("intermediate", "prediction"))

    @nnx.jit
    def everything(model, regression):
        loss = lambda m, o: task_distillation_loss(m, batch, None, objective=o)  # noqa: E731
        grads = nnx.grad(lambda m: loss(m, second)[0])(model)
        return (loss(regression, second), loss(model, first), loss(model, second), model(*inputs),
                model.student(*inputs), model.teacher(*inputs), grads)

    regressed, (loss1, metrics1), (loss2, metrics2), out, own, theirs, grads = everything(*models)
    np.testing.assert_allclose(out.student_logits, own, atol=1e-6)
    np.testing.assert_allclose(out.teacher_logits, theirs, atol=1e-6)
    layers = out.layers
    additive = (1 - mask)[:, None, None, :] * -10000.0
    att, rep = np_general_loss(list(np.asarray(layers.student_scores) + additive),
                               list(np.asarray(layers.teacher_scores) + additive),
                               list(np.asarray(layers.student_states)),
                               list(np.asarray(layers.teacher_states)), mask)
    np.testing.assert_allclose(float(loss1), att + rep, rtol=1e-5)
    np.testing.assert_allclose(float(metrics1["att_loss"][0]), att, rtol=1e-5)
    student, teacher = np.asarray(own, np.float64), np.asarray(theirs, np.float64)
    np.testing.assert_allclose(float(loss2), np_soft_cross_entropy(student, teacher, 1.0),
                               rtol=1e-5)
    correct = (student.argmax(-1) == np.asarray(batch["label"])).sum()
    assert tuple(float(v) for v in metrics2["accuracy"]) == (correct, 4)
    assert "teacher" not in grads and not float(jnp.abs(grads["fit"]["dense"]["kernel"][...]).sum())
    assert float(jnp.abs(grads["student"]["head_output"]["kernel"][...]).sum()) > 0
    score = np.asarray(models[1].student(*inputs))[:, 0]
    np.testing.assert_allclose(float(regressed[0]),
                               np.mean((score - np.asarray(batch["label"])) ** 2), rtol=1e-5)


@pytest.fixture(scope="module")
def glue_folder(tmp_path_factory):
    """SST-2 of the test vocabulary's words: 64 training rows, 32 dev rows."""
    root = tmp_path_factory.mktemp("glue")
    rng = np.random.default_rng(0)
    (root / "SST-2").mkdir()
    for split, count in (("train", 64), ("dev", 32)):
        rows = [" ".join(rng.choice(WORDS[:-1], 6)) + f"\t{i % 2}" for i in range(count)]
        (root / "SST-2" / f"{split}.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    return root


def test_task_distillation_starts_reads_glue_and_refuses_in_one_line(teacher, glue_folder,
                                                                      tmp_path):
    """The start of a task-distillation run (no trainer: its step is the one the general
    runs above check): the fine-tuned teacher (HF `BertForSequenceClassification`), head
    included, frozen bit for bit; SST-2 prepared with the teacher's vocabulary and the
    student's GLUE metrics on the dev set; the prediction stage started from the intermediate
    stage's student whole (head included, through its HF export). A teacher that is not a
    classifier, or has another number of labels, and a student start of another shape are
    refused in one line."""
    torch.manual_seed(0)
    classifier = hf_teacher(tmp_path / "classifier", "BertForSequenceClassification")
    values = {"data.source": str(glue_folder), "data.tokenizer": str(classifier / "vocab.txt"),
              **{k: v for k, v in run_overrides(tmp_path, classifier).items()
                 if k.startswith(("model.", "examples."))}}
    run = make_config("tinybert_task_tiny", values)
    config = dataclasses.replace(run.model, vocab_size=len(VOCAB))
    model = pretrained_tinybert_task(config, 0, load_pretrained)
    theirs = flat_params(nnx.state(load_pretrained(classifier), nnx.Param))
    frozen = flat_params(nnx.state(model.teacher, Frozen))
    assert len(frozen) == len(theirs)
    for key, value in frozen.items():
        np.testing.assert_array_equal(value, theirs[key])
    prepared = prepare_task(run.data, run.examples, tmp_path / "cache", 0)
    assert prepared.model_fields == {"num_labels": 2, "vocab_size": len(VOCAB)}
    assert prepared.eval["input_ids"].shape == (32, 24)
    assert 0.0 <= student_glue_metrics(model, prepared, run.examples)["accuracy"] <= 1.0

    hf.save(model.student, tmp_path / "stage1")  # the intermediate stage's student
    second = pretrained_tinybert_task(dataclasses.replace(config, init=str(tmp_path / "stage1")),
                                      1, load_pretrained)
    ours = flat_params(nnx.state(second.student, nnx.Param))
    for key, value in flat_params(nnx.state(model.student, nnx.Param)).items():
        np.testing.assert_array_equal(ours[key], value, err_msg=key)

    def refusal(path=classifier, **fields):
        with pytest.raises(UserError) as error:
            pretrained_tinybert_task(dataclasses.replace(config, teacher=str(path), **fields),
                                     0, load_pretrained)
        assert "\n" not in str(error.value)
        return str(error.value)

    assert "not a BERT classifier" in refusal(path=teacher)
    assert "has 2 outputs, the task 3" in refusal(num_labels=3)
    assert "set model.num_heads=2" in refusal(num_heads=4)
    assert "set model.hidden_size=32" in refusal(init=str(teacher))
    with pytest.raises(UserError, match="objective.stage"):
        make_config("tinybert_task_tiny", {"objective.stage": "both"})
