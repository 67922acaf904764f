"""InfoWord (Kong et al. 2020 §4): the sentence / n-gram InfoNCE term and its gradient against
numpy, the n-gram sampler's statistics over many draws against its definition, the masked-LM part
equal to BERT's loss on the same batch, the whole loss against a numpy re-statement, and
training: a killed run resumes exactly with a falling loss and exports as HF BertForPreTraining,
and one step is equal on every mesh; refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity_utils import assert_same_params
from resilience_utils import (
    GRADIENT_STEP,
    TINY_BERT,
    abort_and_resume,
    assert_same_step_on_every_mesh,
    assert_same_training,
    mesh_overrides,
    run_in_process,
    small_corpus,
    train_losses,
)
from text_utils import unique_token_documents

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples.bert import MaskingVocab, prediction_budget
from pretext_jax.input_pipeline.examples.infoword import (
    InfoWordExampleConfig,
    create_training_examples,
)
from pretext_jax.models.bert import Bert
from pretext_jax.models.encoder import EncoderConfig
from pretext_jax.objectives.bert import bert_loss
from pretext_jax.objectives.common.contrastive import in_batch_info_nce
from pretext_jax.objectives.infoword import InfoWordSettings, infoword_loss
from pretext_jax.pretrain import hf
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.export import convert
from pretext_jax.pretrain.loading import load_model
from pretext_jax.pretrain.trainer import Trainer

MASK, VOCAB_SIZE = 3, 6100
VOCAB = MaskingVocab(VOCAB_SIZE, 0, 1, 2, MASK, np.zeros(VOCAB_SIZE, bool))
CONFIG = InfoWordExampleConfig(max_seq_length=48, max_predictions_per_seq=8, dupe_factor=20)
FIRST = 10  # token ids >= FIRST are unique: 10 + 100 * document + place in it


def documents() -> list[list[list[int]]]:
    """60 documents of 8 sentences of 2-10 tokens, every token id unique (never [MASK])."""
    return unique_token_documents(FIRST, 100, (2, 10))


@pytest.fixture(scope="module")
def records() -> list[dict[str, np.ndarray]]:
    return list(create_training_examples(documents(), VOCAB, CONFIG, seed=3))


def original(record: dict[str, np.ndarray]) -> np.ndarray:
    """The example's tokens before masking, from its targets."""
    tokens = record["input_ids"].copy()
    keep = record["masked_lm_weights"] > 0
    tokens[record["masked_lm_positions"][keep]] = record["masked_lm_ids"][keep]
    return tokens


def runs_of(free: np.ndarray) -> list[tuple[int, int]]:
    """(start, length) of the maximal runs of True, written out plainly."""
    runs, start = [], None
    for i, value in enumerate([*free.tolist(), False]):
        if value and start is None:
            start = i
        elif not value and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


def test_in_batch_info_nce_and_its_gradient_against_numpy():
    """loss = mean_i [log sum_j exp(q_i . k_j) - q_i . k_i] (§4's I_DIM, negated), and its
    gradients (softmax(QK^T) K - K) / N and (softmax(QK^T)^T Q - Q) / N; a control: the same
    keys in another order score a different loss."""
    rng = np.random.default_rng(0)
    queries, keys = rng.normal(size=(2, 6, 5))
    logits = queries @ keys.T
    shifted = np.exp(logits - logits.max(1, keepdims=True))
    p = shifted / shifted.sum(1, keepdims=True)
    expected = np.mean(np.log(shifted.sum(1)) + logits.max(1) - np.diag(logits))
    loss, metrics = in_batch_info_nce(jnp.asarray(queries), jnp.asarray(keys))
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    assert float(metrics["contrastive_accuracy"][0]) == np.sum(logits.argmax(1) == np.arange(6))
    grad_q, grad_k = jax.grad(lambda q, k: in_batch_info_nce(q, k)[0], argnums=(0, 1))(
        jnp.asarray(queries, jnp.float32), jnp.asarray(keys, jnp.float32))
    np.testing.assert_allclose(grad_q, (p @ keys - keys) / 6, atol=1e-6)
    np.testing.assert_allclose(grad_k, (p.T @ queries - queries) / 6, atol=1e-6)
    permuted, _ = in_batch_info_nce(jnp.asarray(queries), jnp.asarray(keys[::-1]))
    assert abs(float(permuted) - expected) > 0.1


def test_ngram_sampler_follows_its_definition(records):
    """Over ~2,600 examples: the n-gram lies inside one segment; its length is uniform on
    1..5 where all five fit; its start uniform over the places it fits; all its tokens are
    [MASK] and targets, and the n-gram view is [CLS] x_i..x_j [SEP]; the targets number
    max(n, BERT's budget); the other targets are corrupted 80/10/10 and everything else is
    unmoved."""
    lengths, ranks, counted = [], [], {"mask": 0, "kept": 0, "other": 0}
    for record in records:
        tokens, length = original(record), int(record["input_mask"].sum())
        free = np.zeros(len(tokens), bool)
        free[1:length] = tokens[1:length] != VOCAB.sep_id
        n = int(record["ngram_mask"].sum()) - 2
        ngram = record["ngram_ids"][1:n + 1]
        assert record["ngram_ids"][0] == VOCAB.cls_id and record["ngram_ids"][n + 1] == VOCAB.sep_id
        start = int(np.flatnonzero(tokens == ngram[0])[0])
        span = np.arange(start, start + n)
        np.testing.assert_array_equal(tokens[span], ngram)
        assert free[span].all() and (record["input_ids"][span] == MASK).all()
        runs = runs_of(free)
        places = [s for run, size in runs if size >= n for s in range(run, run + size - n + 1)]
        ranks.append((places.index(start) + 0.5) / len(places))
        if max(size for _, size in runs) >= CONFIG.ngram_max_length:
            lengths.append(n)
        targets = record["masked_lm_positions"][record["masked_lm_weights"] > 0]
        assert set(span) <= set(targets)
        assert len(targets) == max(n, prediction_budget(length, CONFIG))
        others = np.setdiff1d(targets, span)
        shown = record["input_ids"][others]
        counted["mask"] += int(np.sum(shown == MASK))
        counted["kept"] += int(np.sum(shown == tokens[others]))
        counted["other"] += int(np.sum((shown != MASK) & (shown != tokens[others])))
        rest = np.setdiff1d(np.arange(len(tokens)), targets)
        np.testing.assert_array_equal(record["input_ids"][rest], tokens[rest])
    assert len(lengths) > 1500
    counts = np.bincount(lengths, minlength=6)[1:]
    assert counts.sum() == len(lengths)
    for count in counts:  # 1/5 each, within 4 standard deviations
        assert abs(count / len(lengths) - 0.2) < 4 * np.sqrt(0.16 / len(lengths)), counts
    ranks = np.asarray(ranks)  # uniform on (0, 1): mean 1/2, a quarter in each quartile
    assert abs(ranks.mean() - 0.5) < 4 * np.sqrt(1 / 12 / len(ranks))
    quartiles = np.histogram(ranks, bins=4, range=(0, 1))[0] / len(ranks)
    assert np.all(np.abs(quartiles - 0.25) < 4 * np.sqrt(0.1875 / len(ranks))), quartiles
    total = sum(counted.values())
    assert total > 2000
    for kind, share in (("mask", 0.8), ("kept", 0.1), ("other", 0.1)):
        assert abs(counted[kind] / total - share) < 4 * np.sqrt(share * (1 - share) / total)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_loss_against_numpy_and_its_mlm_part_is_berts(records):
    """The loss in numpy from the model's outputs (full-sequence MLM logits; [CLS] of the masked
    sentence and of the n-gram encoded alone): any weights, and the default MLM + DIM (§4's two
    terms, no NSP); with dim_weight 0 and next_sentence_weight 1 it is BERT's loss on the same
    batch exactly, and BERT's MLM is InfoWord's MLM metric."""
    config = EncoderConfig(vocab_size=VOCAB_SIZE, hidden_size=16, num_layers=1, num_heads=2,
                           intermediate_size=32, max_position_embeddings=48)
    model = Bert(config, rngs=nnx.Rngs(0))
    numpy_batch = {k: np.stack([r[k] for r in records[:8]]) for k in records[0]}
    batch = {k: jnp.asarray(v) for k, v in numpy_batch.items()}
    settings = InfoWordSettings(mlm_weight=0.7, dim_weight=1.5, next_sentence_weight=0.3)
    total, metrics = infoword_loss(model, batch, None, objective=settings)
    out = model(batch["input_ids"], batch["segment_ids"], batch["input_mask"])
    log_p = log_softmax(np.asarray(out.mlm_logits, np.float64))
    rows = np.arange(8)[:, None]
    weights = numpy_batch["masked_lm_weights"]
    nll = -log_p[rows, numpy_batch["masked_lm_positions"], numpy_batch["masked_lm_ids"]]
    mlm = (weights * nll).sum() / (weights.sum() + 1e-5)
    nsp = -log_softmax(np.asarray(out.nsp_logits, np.float64))[
        np.arange(8), numpy_batch["next_sentence_labels"]].mean()
    sentence = np.asarray(out.hidden_states[:, 0], np.float64)
    ngram = np.asarray(model.encoder(batch["ngram_ids"], jnp.zeros_like(batch["ngram_ids"]),
                                     batch["ngram_mask"], None)[:, 0], np.float64)
    scores = sentence @ ngram.T
    dim = np.mean(-np.diag(log_softmax(scores)))
    np.testing.assert_allclose(float(total), 0.7 * mlm + 1.5 * dim + 0.3 * nsp, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["dim_loss"][0] / 8), dim, rtol=1e-5)
    default, _ = infoword_loss(model, batch, None, objective=InfoWordSettings())
    np.testing.assert_allclose(float(default), mlm + dim, rtol=1e-5)
    # the MLM (+ NSP) part is BERT's own loss on the same batch, to the bit
    bert_weights = InfoWordSettings(dim_weight=0.0, next_sentence_weight=1.0)
    without_dim, ours = infoword_loss(model, batch, None, objective=bert_weights)
    theirs_total, theirs = bert_loss(model, batch, None)
    assert float(without_dim) == float(theirs_total)
    for key in ("mlm_loss", "mlm_accuracy", "nsp_loss", "nsp_accuracy"):
        assert [float(x) for x in ours[key]] == [float(x) for x in theirs[key]], key
    # control: with NSP and DIM, the loss is BERT's plus the DIM term
    both, _ = infoword_loss(model, batch, None, objective=InfoWordSettings(next_sentence_weight=1))
    np.testing.assert_allclose(float(both) - float(theirs_total), dim, rtol=1e-4)


def test_killed_run_resumes_bit_for_bit_falls_and_exports_as_bert(tmp_path):
    """infoword_tiny (scaled down) killed in place of step 5 (`abort_and_resume`: the step-3
    checkpoint is the last), then rerun: the same batches, losses and parameters as an
    uninterrupted run, whose loss falls over its 8 steps; the trained model converts to HF
    BertForPreTraining (BERT's conversion) and reads back as the same parameters."""
    overrides = {**TINY_BERT, **small_corpus(tmp_path)}
    reference = tmp_path / "reference", tmp_path / "reference.log"
    run_in_process("infoword_tiny", overrides, *reference)
    ours = abort_and_resume("infoword_tiny", overrides, tmp_path, step=5)
    assert len(assert_same_training("infoword_tiny", overrides, ours, reference)) > 8
    losses = train_losses(reference[0])
    assert losses[8] < losses[1] - 0.1, losses
    convert(reference[0], tmp_path / "hf", to="hf")
    assert '"BertForPreTraining"' in (tmp_path / "hf" / "config.json").read_text()
    assert_same_params(hf.load(tmp_path / "hf"), load_model(reference[0]))


def test_same_step_on_every_mesh(tmp_path):
    base = {**TINY_BERT, **small_corpus(tmp_path), **GRADIENT_STEP, "train.steps": 1}

    def trainer_at(workdir, mesh, devices):
        return Trainer(make_config("infoword_tiny", {**base, **mesh_overrides(mesh)}),
                       workdir, devices=devices)

    batch = assert_same_step_on_every_mesh(trainer_at, tmp_path)
    assert batch["ngram_mask"].sum() > 3 * len(batch["ngram_mask"])


@pytest.mark.parametrize(("section", "overrides", "match"), [
    ("examples", {"dynamic_masking": True}, "dynamic_masking"),
    ("examples", {"whole_word_mask": True}, "whole_word_mask"),
    ("examples", {"ngram_min_length": 3, "ngram_max_length": 2}, "ngram_min_length"),
    ("examples", {"ngram_max_length": 30}, "max_predictions_per_seq"),
    ("objective", {"dim_weight": -1.0}, "dim_weight"),
    ("model", {"max_position_embeddings": 6}, "max_position_embeddings"),
])
def test_refusals(section, overrides, match):
    with pytest.raises(UserError, match=match):
        make_config("infoword_tiny", {f"{section}.{k}": v for k, v in overrides.items()}
                    | ({"examples.max_seq_length": 6} if section == "model" else {}))
