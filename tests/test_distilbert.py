"""DistilBERT (Sanh et al. 2019): the student against HF `DistilBertForMaskedLM` (parity and
round trip), each loss term against numpy re-statements of distiller.py (the soft targets'
T^2, the cosine loss's padding mask), the student's start from the teacher's layers
(extract_distilbert.py), a frozen teacher (not a parameter, no optimizer state, unchanged by
training), a sharded step equal to the single-device one, a killed run's exact resume, and bad
teachers and settings refused in one line."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity_utils import (
    MASKED_POSITIONS,
    Parity,
    assert_gathered,
    converted,
    hf_reference,
    padded_inputs,
    random_model,
)
from resilience_utils import (
    GRADIENT_STEP,
    abort_and_resume,
    assert_same_step_on_every_mesh,
    assert_same_training,
    flat_params,
    mesh_overrides,
    run_in_process,
    small_corpus,
)

from pretext_jax.errors import UserError
from pretext_jax.models.distilbert import (
    DistilBert,
    DistilBertConfig,
    Distillation,
    DistillationConfig,
    Teacher,
    student_from_teacher,
)
from pretext_jax.models.layers import Frozen
from pretext_jax.objectives.distilbert import (
    DistillationSettings,
    cosine_loss,
    distillation_loss,
    pretrained_distillation,
    soft_target_loss,
)
from pretext_jax.pretrain import hf
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.loading import load_pretrained
from pretext_jax.pretrain.trainer import Trainer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


# --- the student: HF DistilBertForMaskedLM --------------------------------------------------

def hf_outputs(model, ids, mask):
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    return {"hidden_states": out.hidden_states[-1], "mlm_logits": out.logits}


def our_outputs(model, ids, mask):
    out = model(ids, mask)
    return {"hidden_states": out.hidden_states, "mlm_logits": out.mlm_logits}


DISTILBERT = Parity("DistilBertForMaskedLM", hf_outputs, our_outputs)


@pytest.mark.usefixtures("deterministic_torch")
def test_parity_with_hf_and_round_trip(tmp_path):
    """Hidden states and logits at every position (padding included) within 1e-5 of HF's,
    gathered logits equal, and our random model exported, read by transformers and back."""
    config = dict(vocab_size=99, dim=32, n_layers=2, n_heads=4, hidden_dim=37,
                  max_position_embeddings=40, activation="gelu", dropout=0.1)
    reference = DISTILBERT.reference(0, **config)
    model = converted(reference, tmp_path / "hf")
    assert isinstance(model, DistilBert) and model.config.type_vocab_size == 0
    ids, _, mask = padded_inputs(99, 1, 0)
    expected = DISTILBERT.assert_parity(model, reference, ids, mask)
    gathered = model(jnp.asarray(ids), jnp.asarray(mask),
                     masked_positions=jnp.asarray(MASKED_POSITIONS)).mlm_logits
    assert_gathered(gathered, expected["mlm_logits"])
    ours = random_model(DistilBert, DistilBertConfig(
        vocab_size=50, hidden_size=24, num_layers=2, num_heads=3, intermediate_size=40,
        max_position_embeddings=24, hidden_act="relu", hidden_dropout=0.2), 1)
    _, saved = DISTILBERT.round_trip(ours, tmp_path / "exported", *padded_inputs(50, 1, 4)[::2])
    assert saved["activation"] == "relu" and saved["dropout"] == 0.2
    with pytest.raises(ValueError, match="DistilBERT has type_vocab_size=0"):
        DistilBertConfig(type_vocab_size=2)


# --- the loss against numpy -----------------------------------------------------------------

def np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def np_soft_target_loss(s, t, mask, temperature):
    """distiller.py: KLDivLoss(batchmean)(log_softmax(s/T), softmax(t/T)) over the rows where
    `mask` is 1, times T^2."""
    rows = mask.astype(bool)
    log_q, log_p = np_log_softmax(s[rows] / temperature), np_log_softmax(t[rows] / temperature)
    return (np.exp(log_p) * (log_p - log_q)).sum() / rows.sum() * temperature ** 2


def np_cosine_loss(s, t, mask):
    """CosineEmbeddingLoss(mean) with target 1 over the rows where `mask` is 1."""
    rows = mask.astype(bool)
    s, t = s[rows].astype(np.float64), t[rows].astype(np.float64)
    cos = (s * t).sum(-1) / np.sqrt(((s * s).sum(-1) + 1e-12) * ((t * t).sum(-1) + 1e-12))
    return (1 - cos).mean()


def test_each_loss_term_against_numpy():
    rng = np.random.default_rng(0)
    s, t = rng.normal(size=(2, 3, 5, 11)) * 3
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    for temperature in (1.0, 2.0):
        got = float(soft_target_loss(jnp.asarray(s), jnp.asarray(t), jnp.asarray(mask),
                                     temperature))
        np.testing.assert_allclose(got, np_soft_target_loss(s, t, mask, temperature), rtol=1e-5)
    # T^2: at T = 2 the term is 4 x the KL of the softened distributions (not the plain KL).
    assert np.isclose(np_soft_target_loss(s, t, mask, 2.0),
                      4 * np_soft_target_loss(s / 2, t / 2, mask, 1.0))
    # torch's own KLDivLoss and CosineEmbeddingLoss on the selected rows agree.
    rows = torch.as_tensor(mask.astype(bool))
    kl = torch.nn.KLDivLoss(reduction="batchmean")(
        torch.log_softmax(torch.as_tensor(s)[rows] / 2, -1),
        torch.softmax(torch.as_tensor(t)[rows] / 2, -1)) * 4
    np.testing.assert_allclose(np_soft_target_loss(s, t, mask, 2.0), kl.item(), rtol=1e-10)
    hs, ht = rng.normal(size=(2, 3, 5, 8))
    ht[0, 3:] = -hs[0, 3:]  # padding where the two disagree: must not count
    cos = float(cosine_loss(jnp.asarray(hs), jnp.asarray(ht), jnp.asarray(mask)))
    np.testing.assert_allclose(cos, np_cosine_loss(hs, ht, mask), rtol=1e-5)
    reference = torch.nn.CosineEmbeddingLoss()(torch.as_tensor(hs)[rows],
                                               torch.as_tensor(ht)[rows],
                                               torch.ones(int(mask.sum())))
    np.testing.assert_allclose(cos, reference.item(), rtol=1e-5)
    assert abs(cos - np_cosine_loss(hs, ht, np.ones_like(mask))) > 0.05  # the mask matters


TINY = DistillationConfig(vocab_size=30, hidden_size=16, num_layers=1, num_heads=2,
                          intermediate_size=24, max_position_embeddings=16,
                          teacher_num_layers=2, teacher_num_heads=4,
                          teacher_intermediate_size=20, teacher_max_position_embeddings=16,
                          hidden_dropout=0.0, attention_dropout=0.0)


def test_the_whole_loss_is_the_weighted_sum_of_its_terms():
    """distillation_loss = 5 L_ce + 2 L_mlm + 1 L_cos on the networks' own outputs, each term
    computed here in numpy from them; with alpha_ce 0 (a teacher without an MLM head) the
    soft-target term and the teacher's logits are gone."""
    model = nnx.eval_shape(lambda: Distillation(TINY, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(1)
    for _, variable in nnx.to_flat_state(nnx.state(model, (nnx.Param, Frozen))):
        shape = variable.get_value().shape  # off the init, so the two networks differ clearly
        variable.set_value(jnp.asarray(0.3 * rng.standard_normal(shape), jnp.float32))
    mask = np.ones((2, 9), np.int32)
    mask[1, 6:] = 0
    batch = {"input_ids": rng.integers(0, 30, (2, 9)), "input_mask": mask,
             "masked_lm_positions": np.array([[1, 4, 0], [2, 5, 0]]),
             "masked_lm_ids": rng.integers(0, 30, (2, 3)),
             "masked_lm_weights": np.array([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])}
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    settings, no_soft = DistillationSettings(), DistillationSettings(alpha_ce=0.0)

    @nnx.jit
    def everything(model, batch):
        """Both losses, the outputs and the gradient, in one compiled program."""
        loss = lambda m, o: distillation_loss(m, batch, None, objective=o)  # noqa: E731
        out = model(batch["input_ids"], batch["input_mask"], batch["masked_lm_positions"],
                    soft_targets=True)
        grads = nnx.grad(lambda m: loss(m, settings)[0])(model)
        return loss(model, settings), loss(model, no_soft), out, grads

    (loss, metrics), (loss0, metrics0), out, grads = everything(model, batch)
    s, t = np.asarray(out.student_logits), np.asarray(out.teacher_logits)
    positions, labels = (np.asarray(batch[k])[..., None] for k in ("masked_lm_positions",
                                                                   "masked_lm_ids"))
    nll = -np.take_along_axis(np_log_softmax(np.take_along_axis(s, positions, 1)), labels,
                              -1)[..., 0]
    weights = np.asarray(batch["masked_lm_weights"])
    mlm = (nll * weights).sum() / weights.sum()
    ce = np_soft_target_loss(s, t, mask, 2.0)
    cos = np_cosine_loss(np.asarray(out.student_hidden), np.asarray(out.teacher_hidden), mask)
    assert min(ce, mlm, cos) > 0.05
    np.testing.assert_allclose(float(loss), 5 * ce + 2 * mlm + cos, rtol=1e-5)
    for name, value in (("ce_loss", ce), ("cos_loss", cos)):
        np.testing.assert_allclose(float(metrics[name][0]), value, rtol=1e-5)
    np.testing.assert_allclose(float(loss0), 2 * mlm + cos, rtol=1e-5)
    assert "ce_loss" not in metrics0
    # The teacher gets no gradient: its weights are not parameters.
    assert "teacher" not in grads and jax.tree.leaves(grads["student"])


def test_student_layers_come_from_every_other_teacher_layer_or_the_chosen_ones():
    """extract_distilbert.py: student layer i <- teacher layer 2i by default, or
    `init_layers[i]`; with `init_vocab_transform` the LM head's transform too. Compute in the
    student's dtype for the teacher as well (bfloat16 when the student trains in it)."""
    for chosen, expected in (((), [0, 2, 4]), ((4, 1, 0), [4, 1, 0])):
        config = dataclasses.replace(TINY, num_layers=3, teacher_num_layers=5,
                                     init_layers=chosen, init_vocab_transform=bool(chosen))
        model = random_model(Distillation, config, 0)
        teacher = random_model(functools.partial(Teacher, mlm_head=True),
                               config.teacher_config(), 1)
        student_from_teacher(model.student, teacher, config.student_init_layers,
                             config.init_vocab_transform)
        ours = model.student.encoder.stack.layers.query.kernel[...]
        np.testing.assert_array_equal(ours, teacher.encoder.stack.layers.query.kernel[...][
            np.asarray(expected)])
        same = np.array_equal(model.student.lm_head.dense.kernel[...],
                              teacher.lm_head.dense.kernel[...])
        assert same == bool(chosen)
    assert dataclasses.replace(TINY, dtype="bfloat16").teacher_config().dtype == "bfloat16"


# --- a run with a teacher ---------------------------------------------------------------------

WORDS = ["sentence", "talks", "about", "topic", "and", "then", "some", "more", "words", "."]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *map(str, range(10)),
         *(f"##{d}" for d in range(10))]


def hf_teacher(folder, architecture="BertForMaskedLM"):
    """A random HF BERT of 2 layers of 32 saved with the WordPiece vocabulary of `VOCAB`."""
    model = hf_reference(architecture, 0, vocab_size=len(VOCAB), hidden_size=32,
                         num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
                         max_position_embeddings=64)
    model.save_pretrained(folder)
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    return folder


def run_overrides(root, teacher, **extra):
    return {**small_corpus(root), "data.tokenizer": str(teacher / "vocab.txt"),
            "model.teacher": str(teacher), "model.hidden_size": 32, "model.num_heads": 2,
            "model.intermediate_size": 48, "model.max_position_embeddings": 64,
            "model.teacher_num_heads": 2, "model.teacher_intermediate_size": 48,
            "model.teacher_max_position_embeddings": 64, "examples.max_seq_length": 24,
            "examples.max_predictions_per_seq": 4, "train.batch_size": 8, "train.steps": 4,
            "train.log_every": 1, "train.eval_every": 1000, "train.eval_batches": 1,
            "train.checkpoint_every": 2, "train.progress": False, **extra}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    torch.manual_seed(0)
    return hf_teacher(tmp_path_factory.mktemp("teacher"))


def test_student_starts_from_the_teachers_layers_and_the_teacher_stays_frozen(teacher,
                                                                              tmp_path):
    """The fresh state: the student's embeddings, LayerNorm, layer i = teacher layer 2i and the
    LM bias are the teacher's (its token types and LM transform are not taken); the teacher's
    weights are `Frozen` model state, never parameters or optimizer state. A run killed in
    place of step 3 and resumed ends bit for bit as an uninterrupted one, with the teacher
    unchanged."""
    values = run_overrides(tmp_path, teacher)
    trainer = Trainer(make_config("distilbert_tiny", values), tmp_path / "init")
    state = trainer.init_state()
    params, rest = flat_params(state.params), flat_params(state.model_state)
    bert = load_pretrained(teacher)
    theirs = flat_params(nnx.state(bert, nnx.Param))
    assert not any("teacher" in k for k in params)
    assert not any("teacher" in str(path) for path, _ in
                   jax.tree_util.tree_leaves_with_path(state.opt_state))
    for key, value in params.items():
        source = theirs[key.replace("['student']", "")]
        if "['layers']" in key:  # student layer 0 <- teacher layer 0 (of 2)
            np.testing.assert_array_equal(value[0], source[0], err_msg=key)
        elif "['lm_head']" in key:  # the output bias only (extract_distilbert.py's default)
            assert np.array_equal(value, source) == key.endswith("['lm_head']['bias'].value")
        else:
            np.testing.assert_array_equal(value, source, err_msg=key)
    frozen = {k: v for k, v in rest.items() if k.startswith("['teacher']")}
    assert len(frozen) == len(theirs) - 4  # all but the pooler and the NSP layer
    for key, value in frozen.items():
        np.testing.assert_array_equal(value, theirs[key.replace("['teacher']", "")])
    assert all(isinstance(v, Frozen) for v in jax.tree.leaves(
        nnx.state(trainer.model_of(state).teacher), is_leaf=lambda x: isinstance(x, nnx.Variable)))
    trainer.checkpoints.close()

    reference = tmp_path / "reference", tmp_path / "reference.log"
    run_in_process("distilbert_tiny", values, *reference)
    ours = abort_and_resume("distilbert_tiny", values, tmp_path, step=3)
    assert len(assert_same_training("distilbert_tiny", values, ours, reference)) > 4
    end = Trainer(make_config("distilbert_tiny", values), ours[0])
    final, _ = end.checkpoints.restore_latest_readable()
    end.checkpoints.close()
    for key, value in flat_params(final.model_state).items():
        np.testing.assert_array_equal(value, frozen[key], err_msg=key)
    moved = flat_params(final.params)
    assert any(not np.array_equal(moved[k], params[k]) for k in params)


def test_sharded_step_equals_single_device_step(teacher, tmp_path):
    """One step on the (2, 2, 2) mesh equals the single-device step; the teacher's weights are
    placed by the same logical names as the student's."""
    def trainer_at(workdir, mesh, devices):
        values = run_overrides(tmp_path, teacher, **GRADIENT_STEP, **mesh_overrides(mesh))
        trainer = Trainer(make_config("distilbert_tiny", values), workdir, devices=devices)
        student = trainer.state_sharding.params["student"]
        frozen = trainer.state_sharding.model_state["teacher"]
        for name in ("encoder", "stack", "layers", "intermediate", "kernel"):
            student, frozen = student[name], frozen[name]
        assert student.spec == frozen.spec and (mesh == (1, 1, 1) or any(student.spec))
        return trainer

    assert assert_same_step_on_every_mesh(trainer_at, tmp_path)["input_ids"].shape == (8, 24)


@pytest.mark.usefixtures("deterministic_torch")
def test_bad_teachers_and_settings_are_refused_in_one_line(teacher, tmp_path):
    config = make_config("distilbert_tiny", run_overrides(tmp_path, teacher)).model

    def refusal(path=teacher, **fields):
        with pytest.raises(UserError) as error:
            pretrained_distillation(dataclasses.replace(config, teacher=str(path), **fields),
                                    0, load_pretrained)
        assert "\n" not in str(error.value)
        return str(error.value)

    config = dataclasses.replace(config, vocab_size=len(VOCAB))
    assert "model.teacher is empty" in refusal(path="")
    assert "not a directory" in refusal(path=tmp_path / "absent")
    assert "set model.hidden_size=32" in refusal(hidden_size=16, num_heads=2)
    assert "data.tokenizer=" in refusal(vocab_size=40)
    assert "set model.max_position_embeddings=64" in refusal(max_position_embeddings=32)
    assert "set model.teacher_num_layers=2 model.teacher_intermediate_size=48" in refusal(
        teacher_num_layers=3, init_layers=(2,), teacher_intermediate_size=64)
    # A bare BertModel (a sentence-transformers model such as all-MiniLM-L6-v2) has no head.
    bare = hf_teacher(tmp_path / "bare", "BertModel")
    assert "model.teacher_mlm_head=false" in refusal(path=bare)
    with pytest.raises(UserError, match="set objective.alpha_ce=0"):
        make_config("distilbert_tiny", {"model.teacher_mlm_head": False})
    make_config("distilbert_tiny", {"model.teacher_mlm_head": False, "objective.alpha_ce": 0})
    with pytest.raises(UserError, match="positive sum"):
        make_config("distilbert_tiny", {"objective.alpha_ce": 0, "objective.alpha_mlm": 0,
                                        "objective.alpha_cos": 0})
    with pytest.raises((UserError, ValueError), match="init_layers"):
        make_config("distilbert_tiny", {"model.init_layers": [5]})
    electra = tmp_path / "electra"
    hf.save(random_model(DistilBert, DistilBertConfig(
        vocab_size=len(VOCAB), hidden_size=32, num_layers=1, num_heads=2, intermediate_size=8,
        max_position_embeddings=64), 0), electra)
    assert "not a BERT" in refusal(path=electra)
