"""StructBERT (Wang et al. 2020): the sentence structural pairs (next / previous / random at 1/3
each, from the right places), the word structural shuffle (5% of the unmasked trigrams, real
permutations, disjoint from the masks, targets the original tokens), the loss against numpy,
and training: a killed run resumes exactly with a falling loss, and one step equal on every mesh."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
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
from pretext_jax.input_pipeline.examples.bert import MaskingVocab
from pretext_jax.input_pipeline.examples.structbert import (
    StructBertExampleConfig,
    create_training_examples,
)
from pretext_jax.models.bert import Bert
from pretext_jax.models.encoder import EncoderConfig
from pretext_jax.objectives.structbert import StructBertSettings, structbert_loss
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.export import convert
from pretext_jax.pretrain.trainer import Trainer

VOCAB = MaskingVocab(4000, 0, 1, 2, 3, np.zeros(4000, bool))
CONFIG = StructBertExampleConfig(max_seq_length=32, max_predictions_per_seq=5, dupe_factor=10)
FIRST = 10  # token ids >= FIRST name (document, place in it): 10 + 60 * document + place


def documents() -> list[list[list[int]]]:
    """60 documents of 8 sentences of 3-7 tokens; every token id is unique and increases along
    its document, so a token tells where it came from."""
    return unique_token_documents(FIRST, 60, (3, 7))


@pytest.fixture(scope="module")
def records() -> list[dict[str, np.ndarray]]:
    return list(create_training_examples(documents(), VOCAB, CONFIG, seed=3))


def original(record: dict[str, np.ndarray]) -> np.ndarray:
    """The example's tokens before masking and shuffling, from its targets."""
    tokens = record["input_ids"].copy()
    for kind in ("masked_lm", "shuffled"):
        keep = record[f"{kind}_weights"] > 0
        tokens[record[f"{kind}_positions"][keep]] = record[f"{kind}_ids"][keep]
    return tokens


def test_sentence_classes_are_a_third_each_from_the_right_places(records):
    labels = np.array([int(r["next_sentence_labels"]) for r in records])
    assert len(labels) > 1000
    for label in range(3):  # 1/3 each, within 4 standard deviations
        assert abs(np.mean(labels == label) - 1 / 3) < 4 * np.sqrt(2 / 9 / len(labels)), label
    for record, label in zip(records, labels, strict=True):
        tokens = original(record)[:int(record["input_mask"].sum())]
        seg = record["segment_ids"][:len(tokens)]
        a, b = tokens[1:np.flatnonzero(seg == 0)[-1]], tokens[seg == 1][:-1]
        for side in (a, b):  # each segment: consecutive text of one document, in order
            assert (np.diff(side) > 0).all() and len(set((side - FIRST) // 60)) == 1
        same_document = (a[0] - FIRST) // 60 == (b[0] - FIRST) // 60
        assert same_document == (label != 2)
        if label == 0:  # S2 follows S1
            assert a.max() < b.min()
        elif label == 1:  # S2 is the text before S1
            assert b.max() < a.min()


def test_trigram_shuffles_follow_section_2_2(records):
    windows = trigrams = 0
    for record in records:
        tokens, length = original(record), int(record["input_mask"].sum())
        masked = record["masked_lm_positions"][record["masked_lm_weights"] > 0]
        shuffled = record["shuffled_positions"][record["shuffled_weights"] > 0]
        assert len(shuffled) % 3 == 0 and not set(masked) & set(shuffled)
        free = np.zeros(len(tokens), bool)
        free[1:length] = ~np.isin(tokens[1:length], [VOCAB.sep_id])
        free[masked] = False
        assert free[shuffled].all()  # never a masked, special or padding position
        windows += int(np.lib.stride_tricks.sliding_window_view(free, 3).all(axis=1).sum())
        for group in shuffled.reshape(-1, 3):
            trigrams += 1
            assert (np.diff(group) == 1).all()  # three adjacent positions
            now, before = record["input_ids"][group], tokens[group]
            assert sorted(now) == sorted(before) and (now != before).any()
        # targets are the original tokens, everything else is unmoved
        rest = np.setdiff1d(np.arange(length), np.concatenate([masked, shuffled]))
        np.testing.assert_array_equal(record["input_ids"][rest], tokens[rest])
    assert trigrams > 300
    assert abs(trigrams / windows - CONFIG.shuffle_fraction) < 0.01, trigrams / windows


def test_config_errors():
    with pytest.raises(UserError, match="shuffle_fraction"):
        StructBertExampleConfig(shuffle_fraction=1.0)
    with pytest.raises(UserError, match="dynamic_masking"):
        StructBertExampleConfig(dynamic_masking=True)
    with pytest.raises(UserError, match="word_structural_weight"):
        StructBertSettings(word_structural_weight=-1.0)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_loss_is_the_weighted_sum_of_the_three_losses_in_numpy(records):
    """Full-sequence logits from the model, the three losses in numpy: the word loss reads only
    the shuffled positions, with its own weight."""
    config = EncoderConfig(vocab_size=4000, hidden_size=16, num_layers=1, num_heads=2,
                           intermediate_size=32, max_position_embeddings=32)
    model = Bert(config, rngs=nnx.Rngs(0), pair_classes=3)
    batch = {k: np.stack([r[k] for r in records[:8]]) for k in records[0]}
    settings = StructBertSettings(word_structural_weight=0.5, sentence_structural_weight=2.0)
    total, metrics = structbert_loss(model, {k: jnp.asarray(v) for k, v in batch.items()}, None,
                                     objective=settings)
    out = model(jnp.asarray(batch["input_ids"]), jnp.asarray(batch["segment_ids"]),
                jnp.asarray(batch["input_mask"]))
    log_p = log_softmax(np.asarray(out.mlm_logits, np.float64))

    def term(kind: str) -> float:
        rows = np.arange(8)[:, None]
        nll = -log_p[rows, batch[f"{kind}_positions"], batch[f"{kind}_ids"]]
        weights = batch[f"{kind}_weights"]
        return (weights * nll).sum() / (weights.sum() + 1e-5)

    sentence = -log_softmax(np.asarray(out.nsp_logits, np.float64))[
        np.arange(8), batch["next_sentence_labels"]].mean()
    assert batch["shuffled_weights"].sum() > 0
    expected = term("masked_lm") + 0.5 * term("shuffled") + 2.0 * sentence
    np.testing.assert_allclose(float(total), expected, rtol=1e-5)
    word = metrics["word_structural_loss"]
    np.testing.assert_allclose(float(word[0] / word[1]), term("shuffled"), rtol=1e-4)


def test_killed_run_resumes_bit_for_bit_and_its_loss_falls(tmp_path):
    """structbert_tiny (scaled down) killed in place of step 5 (`abort_and_resume`: the step-3
    checkpoint is the last), then rerun: the same batches, losses and parameters as an
    uninterrupted run, whose training loss falls over its 8 steps. Its 3-way sentence head has
    no HF form: export says so in one line."""
    overrides = {**TINY_BERT, **small_corpus(tmp_path)}
    reference = tmp_path / "reference", tmp_path / "reference.log"
    run_in_process("structbert_tiny", overrides, *reference)
    ours = abort_and_resume("structbert_tiny", overrides, tmp_path, step=5)
    assert len(assert_same_training("structbert_tiny", overrides, ours, reference)) > 8
    losses = train_losses(reference[0])
    assert losses[8] < losses[1] - 0.1, losses
    with pytest.raises(UserError, match="sentence head has 3 classes .* no HF form"):
        convert(reference[0], tmp_path / "hf", to="hf")
    assert not (tmp_path / "hf" / "config.json").exists()


def test_same_step_on_every_mesh(tmp_path):
    base = {**TINY_BERT, **small_corpus(tmp_path), **GRADIENT_STEP, "train.steps": 1}

    def trainer_at(workdir, mesh, devices):
        return Trainer(make_config("structbert_tiny", {**base, **mesh_overrides(mesh)}),
                       workdir, devices=devices)

    batch = assert_same_step_on_every_mesh(trainer_at, tmp_path)
    assert batch["shuffled_weights"].sum() > 0 and len(set(batch["next_sentence_labels"])) == 3
