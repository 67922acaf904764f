"""ELECTRA: parity with HF `ElectraForPreTraining` / `ElectraForMaskedLM`, the joint model's
shared embeddings, the objective checked by hand, masking, example packing, export."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity_utils import (
    MASKED_POSITIONS,
    Parity,
    assert_gathered,
    assert_same_params,
    converted,
    padded_inputs,
    random_params,
)

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples.bert import DynamicMasking, MaskingVocab
from pretext_jax.input_pipeline.examples.electra import (
    ElectraExampleConfig,
    create_training_examples,
)
from pretext_jax.models.electra import (
    Electra,
    ElectraConfig,
    ElectraDiscriminator,
    ElectraGenerator,
)
from pretext_jax.models.encoder import EncoderConfig
from pretext_jax.objectives.electra import (
    ElectraLossSettings,
    electra_loss,
    gumbel_noise,
    replaced_token_batch,
)
from pretext_jax.pretrain import hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# HF ElectraConfig fields; the first has embedding_size != hidden_size (projection layers).
CONFIGS = [
    dict(vocab_size=97, embedding_size=24, hidden_size=32, num_hidden_layers=2,
         num_attention_heads=4, intermediate_size=40, max_position_embeddings=40,
         type_vocab_size=2, hidden_act="gelu"),
    dict(vocab_size=64, embedding_size=16, hidden_size=16, num_hidden_layers=3,
         num_attention_heads=2, intermediate_size=24, max_position_embeddings=24,
         type_vocab_size=3, hidden_act="gelu_new", layer_norm_eps=1e-7),
]
HF_CLASSES = {"discriminator": "ElectraForPreTraining", "generator": "ElectraForMaskedLM"}
OUR_CLASSES = {"discriminator": ElectraDiscriminator, "generator": ElectraGenerator}
TINY = ElectraConfig(vocab_size=60, hidden_size=32, embedding_size=24, num_layers=2,
                     num_heads=2, intermediate_size=48, max_position_embeddings=32,
                     generator_hidden_size=0.5, hidden_dropout=0.0, attention_dropout=0.0)
PAPER_LOSS = ElectraLossSettings()  # gen_weight 1, disc_weight 50, temperature 1


pytestmark = pytest.mark.usefixtures("deterministic_torch")


def hf_outputs(model, ids, types, mask):
    out = model(input_ids=ids, token_type_ids=types, attention_mask=mask,
                output_hidden_states=True)
    return {"hidden_states": out.hidden_states[-1], "logits": out.logits}


def our_outputs(model, ids, types, mask):
    out = model(ids, types, mask)
    logits = out.rtd_logits if isinstance(model, ElectraDiscriminator) else out.mlm_logits
    return {"hidden_states": out.hidden_states, "logits": logits}


PARITY = {kind: Parity(architecture, hf_outputs, our_outputs)
          for kind, architecture in HF_CLASSES.items()}


@pytest.mark.parametrize("kind", ["discriminator", "generator"])
@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_parity_with_hf(kind, index, tmp_path):
    config = CONFIGS[index]
    if kind == "generator":  # HF's generator head is always exact GELU (see pretrain/hf.py)
        config = {**config, "hidden_act": "gelu"}
    reference = PARITY[kind].reference(index, **config)
    model = converted(reference, tmp_path)
    assert isinstance(model, OUR_CLASSES[kind])
    assert model.config.embedding_width == config["embedding_size"]
    batch = padded_inputs(config["vocab_size"], config["type_vocab_size"], index)
    expected = PARITY[kind].assert_parity(model, reference, *batch)
    if kind == "generator":  # the head at `masked_positions` = the full logits gathered there
        gathered = model(*map(jnp.asarray, batch),
                         masked_positions=jnp.asarray(MASKED_POSITIONS))
        assert_gathered(gathered.mlm_logits, expected["logits"])


@pytest.mark.parametrize("kind", ["discriminator", "generator"])
def test_parts_round_trip_through_transformers(kind, tmp_path):
    config = EncoderConfig(vocab_size=50, hidden_size=24, embedding_size=12, num_layers=2,
                           num_heads=3, intermediate_size=40, max_position_embeddings=20,
                           type_vocab_size=3, layer_norm_eps=1e-6)
    ours = random_params(OUR_CLASSES[kind](config, rngs=nnx.Rngs(0)), 1)
    _, saved = PARITY[kind].round_trip(ours, tmp_path / "exported", *padded_inputs(50, 3, 5))
    assert saved["embedding_size"] == 12


def test_embeddings_exist_once_and_learn_from_both_losses():
    model = Electra(TINY, rngs=nnx.Rngs(0))
    paths = [".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    assert [p for p in paths if "word_embeddings" in p] == [
        "discriminator.encoder.embeddings.word_embeddings.embedding"]
    assert model.generator.encoder.embeddings is model.discriminator.encoder.embeddings
    # Separate projections: 24 -> 32 for the discriminator, 24 -> 16 for the generator.
    assert model.discriminator.encoder.embeddings_project.kernel.shape == (24, 32)
    assert model.generator.encoder.embeddings_project.kernel.shape == (24, 16)
    batch = masked_batch(TINY.vocab_size)
    rng = jax.random.key(3)

    def embedding_grads(generator_weight, discriminator_weight):
        settings = ElectraLossSettings(generator_weight=generator_weight,
                                       discriminator_weight=discriminator_weight)
        one_term = Electra(TINY, rngs=nnx.Rngs(0))
        grads = nnx.grad(lambda m: electra_loss(m, batch, rng, objective=settings)[0])(one_term)
        return {name: np.asarray(g[...]) for name, g in nnx.to_flat_state(
            grads["discriminator"]["encoder"]["embeddings"])}

    from_generator, from_discriminator = embedding_grads(1.0, 0.0), embedding_grads(0.0, 1.0)
    both = embedding_grads(1.0, 1.0)
    for name in both:
        assert np.abs(from_generator[name]).sum() > 0, ("generator", name)
        assert np.abs(from_discriminator[name]).sum() > 0, ("discriminator", name)
        np.testing.assert_allclose(both[name], from_generator[name] + from_discriminator[name],
                                   atol=1e-6)


def masked_batch(vocab_size: int) -> dict[str, jax.Array]:
    """Two padded rows with three masking slots each (one unused in row 0)."""
    ids = np.array([[2, 11, 4, 13, 14, 4, 16, 3, 0, 0],
                    [2, 21, 22, 4, 24, 25, 3, 27, 28, 3]], np.int32) % vocab_size
    return {
        "input_ids": jnp.asarray(ids),
        "segment_ids": jnp.asarray([[0] * 10, [0] * 7 + [1] * 3], jnp.int32),
        "input_mask": jnp.asarray([[1] * 8 + [0] * 2, [1] * 10], jnp.int32),
        "masked_lm_positions": jnp.asarray([[2, 5, 0], [3, 5, 8]], jnp.int32),
        "masked_lm_ids": jnp.asarray([[12, 15, 0], [23, 25, 28]], jnp.int32),
        "masked_lm_weights": jnp.asarray([[1, 1, 0], [1, 1, 1]], jnp.float32),
    }


def test_replaced_labels_count_a_correct_sample_as_real():
    batch = masked_batch(60)
    # Row 0 samples the original at position 5 (15); row 1 replaces 3 and 8, keeps 5's
    # unmasked original (25) by sampling it. The unused slot (weight 0, position 0) must not
    # touch [CLS].
    sampled = jnp.asarray([[30, 15, 44], [31, 25, 32]], jnp.int32)
    corrupted, replaced = replaced_token_batch(batch, sampled)
    np.testing.assert_array_equal(corrupted, [[2, 11, 30, 13, 14, 15, 16, 3, 0, 0],
                                              [2, 21, 22, 31, 24, 25, 3, 27, 32, 3]])
    np.testing.assert_array_equal(replaced, [[0, 0, 1, 0, 0, 0, 0, 0, 0, 0],
                                             [0, 0, 0, 1, 0, 0, 0, 0, 1, 0]])


def test_loss_equals_a_hand_computed_reference(tmp_path):
    """The objective with fixed Gumbel noise, recomputed in numpy on HF's forward passes of
    the exported generator and discriminator (run_pretraining.py's formulas)."""
    model = random_params(Electra(TINY, rngs=nnx.Rngs(0)), 7)
    hf.save(model, tmp_path)
    generator = transformers.ElectraForMaskedLM.from_pretrained(tmp_path / "generator").eval()
    discriminator = transformers.ElectraForPreTraining.from_pretrained(
        tmp_path / "discriminator").eval()
    batch = masked_batch(TINY.vocab_size)
    np_batch = {k: np.asarray(v) for k, v in batch.items()}
    noise = np.asarray(gumbel_noise(jax.random.key(5), (2, 3, TINY.vocab_size)))
    loss, metrics = electra_loss(model, batch, None, noise=jnp.asarray(noise),
                                 objective=PAPER_LOSS)

    def run(hf_model, ids):
        with torch.no_grad():
            return hf_model(input_ids=torch.tensor(ids, dtype=torch.long),
                            token_type_ids=torch.tensor(np_batch["segment_ids"],
                                                        dtype=torch.long),
                            attention_mask=torch.tensor(np_batch["input_mask"],
                                                        dtype=torch.long)).logits.numpy()

    logits = run(generator, np_batch["input_ids"]).astype(np.float64)
    rows = np.arange(2)[:, None]
    gathered = logits[rows, np_batch["masked_lm_positions"]]  # [2, 3, V]
    log_probs = gathered - np.log(np.exp(gathered).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_probs, np_batch["masked_lm_ids"][..., None], -1)[..., 0]
    weights = np_batch["masked_lm_weights"]
    mlm_loss = (weights * nll).sum() / (weights.sum() + 1e-6)
    sampled = np.argmax(gathered / PAPER_LOSS.temperature + noise, -1)
    original, corrupted = np_batch["input_ids"].copy(), None
    replaced = np.zeros_like(original)
    for row in range(2):
        for slot in range(3):
            if weights[row, slot]:
                original[row, np_batch["masked_lm_positions"][row, slot]] = (
                    np_batch["masked_lm_ids"][row, slot])
    corrupted = original.copy()
    for row in range(2):
        for slot in range(3):
            if weights[row, slot]:
                position = np_batch["masked_lm_positions"][row, slot]
                corrupted[row, position] = sampled[row, slot]
                replaced[row, position] = sampled[row, slot] != original[row, position]
    rtd_logits = run(discriminator, corrupted).astype(np.float64)
    probs = 1 / (1 + np.exp(-rtd_logits))
    bce = -(replaced * np.log(probs) + (1 - replaced) * np.log(1 - probs))
    mask = np_batch["input_mask"]
    rtd_loss = (bce * mask).sum() / (mask.sum() + 1e-6)
    expected = (PAPER_LOSS.generator_weight * mlm_loss
                + PAPER_LOSS.discriminator_weight * rtd_loss)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert float(metrics["mlm_loss"][0] / metrics["mlm_loss"][1]) == pytest.approx(
        mlm_loss, rel=1e-5)
    assert float(metrics["replaced_fraction"][0]) == replaced.sum() > 0
    predicted = (rtd_logits > 0) & (mask > 0)
    assert float(metrics["rtd_precision"][0]) == (predicted & (replaced > 0)).sum()
    assert float(metrics["rtd_precision"][1]) == predicted.sum()
    assert float(metrics["rtd_accuracy"][0]) == ((predicted == (replaced > 0)) & (mask > 0)).sum()


def test_joint_model_saves_as_two_hf_models_and_loads_back(tmp_path):
    model = random_params(Electra(TINY, rngs=nnx.Rngs(0)), 2)
    hf.save(model, tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["discriminator", "generator"]
    back = hf.load(tmp_path / "hf")
    assert isinstance(back, Electra) and back.config == TINY
    assert_same_params(back, model)
    assert hf.method_name(back) == "electra"
    # A generator that is not the one the discriminator implies cannot form a joint model.
    other = ElectraGenerator(dataclasses.replace(TINY.generator_config(), num_heads=4),
                             rngs=nnx.Rngs(0))
    hf.save(other, tmp_path / "hf" / "generator")
    with pytest.raises(UserError, match="load the two parts separately"):
        hf.load(tmp_path / "hf")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="notes.txt"):
        hf.save(model, tmp_path / "other")


VOCAB = MaskingVocab(vocab_size=1000, pad_id=0, cls_id=2, sep_id=3, mask_id=4,
                     continuation=np.zeros(1000, bool))


def documents(seed: int, count: int = 40) -> list[list[list[int]]]:
    rng = np.random.default_rng(seed)
    return [[list(rng.integers(10, 1000, size=rng.integers(1, 30))) for _ in
             range(rng.integers(1, 12))] for _ in range(count)]


def test_examples_pack_consecutive_sentences_into_one_or_two_segments():
    config = ElectraExampleConfig(max_seq_length=48)
    docs = documents(0)
    docs = [[[int(t) for t in s] for s in doc] for doc in docs]
    texts = [[t for s in doc for t in s] for doc in docs]
    examples = list(create_training_examples(docs, VOCAB, config, seed=1))
    two_segments = 0
    for example in examples:
        length = int(example["input_mask"].sum())
        ids, segments = example["input_ids"][:length], example["segment_ids"][:length]
        assert "next_sentence_labels" not in example and "masked_lm_ids" not in example
        assert ids[0] == VOCAB.cls_id and ids[-1] == VOCAB.sep_id and length <= 48
        assert (example["input_ids"][length:] == VOCAB.pad_id).all()
        seps = np.flatnonzero(ids == VOCAB.sep_id)
        first = ids[1:seps[0]]
        assert (segments[: seps[0] + 1] == 0).all() and (segments[seps[0] + 1:] == 1).all()
        two_segments += len(seps) == 2
        content = list(first) + (list(ids[seps[0] + 1:seps[1]]) if len(seps) == 2 else [])
        # Whole sentences of one document (the first segment starts with one; a later short
        # sentence may still join it after others went to the second segment, as in the
        # reference).
        assert any(set(content) <= set(text) for text in texts)
        assert any(first[: len(s)].tolist() == s for doc in docs for s in doc
                   if len(s) <= len(first))
    assert 0.3 < two_segments / len(examples) < 1.0


def test_masking_statistics():
    """15% of the tokens (CLS/SEP included in the count, never chosen), of which 85% become
    [MASK] and 15% stay; no random replacement."""
    config = ElectraExampleConfig(max_seq_length=64, max_predictions_per_seq=10)
    masking = DynamicMasking(VOCAB, config)
    examples = list(create_training_examples(documents(1, 200), VOCAB, config, seed=2))
    rng = np.random.default_rng(0)
    masked_as_mask = kept = total = 0
    for example in examples:
        out = masking.random_map(example, rng)
        length = int(example["input_mask"].sum())
        count = int(out["masked_lm_weights"].sum())
        assert count == min(10, max(1, round(length * 0.15)))
        positions = out["masked_lm_positions"][:count]
        original = example["input_ids"][positions]
        assert (original != VOCAB.cls_id).all() and (original != VOCAB.sep_id).all()
        np.testing.assert_array_equal(out["masked_lm_ids"][:count], original)
        now = out["input_ids"][positions]
        masked_as_mask += int((now == VOCAB.mask_id).sum())
        kept += int((now == original).sum())
        total += count
        unchanged = np.ones(64, bool)
        unchanged[positions] = False
        np.testing.assert_array_equal(out["input_ids"][unchanged], example["input_ids"][unchanged])
    assert masked_as_mask + kept == total > 2000
    assert masked_as_mask / total == pytest.approx(0.85, abs=0.025)


def test_trained_workdir_gives_the_discriminator_in_one_call(tmp_path):
    from pretext_jax import run
    from pretext_jax.pretrain.config import make_config
    from pretext_jax.pretrain.loading import load_model
    from pretext_jax.pretrain.trainer import Trainer

    overrides = {"model.hidden_size": 32, "model.num_layers": 1, "model.num_heads": 2,
                 "model.intermediate_size": 64, "model.embedding_size": 16,
                 "examples.max_seq_length": 32, "examples.max_predictions_per_seq": 5,
                 "data.vocab_size": 800, "data.cache_dir": str(tmp_path / "cache"),
                 "train.steps": 2, "train.batch_size": 8, "train.eval_every": 2,
                 "train.eval_batches": 1, "train.progress": False}
    summary = Trainer(make_config("electra_tiny", overrides), tmp_path / "w").run()
    for name in ("rtd_accuracy", "rtd_precision", "rtd_recall", "replaced_fraction",
                 "mlm_accuracy"):
        assert 0.0 <= summary["eval"][name] <= 1.0
    discriminator = load_model(tmp_path / "w", downstream=True)
    assert isinstance(discriminator, ElectraDiscriminator)
    trained = summary["state"].params["discriminator"]
    np.testing.assert_array_equal(
        np.asarray(discriminator.rtd_output.kernel[...]),
        np.asarray(trained["rtd_output"]["kernel"][...]))
    assert run.main(["convert", str(tmp_path / "w"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    reloaded = transformers.ElectraForPreTraining.from_pretrained(tmp_path / "hf" /
                                                                  "discriminator").eval()
    PARITY["discriminator"].assert_parity(discriminator, reloaded, *padded_inputs(800, 2, 3))
    assert run.main(["convert", str(tmp_path / "hf"), str(tmp_path / "back"), "--to",
                     "pretext"]) == 0
    assert_same_params(load_model(tmp_path / "back"), load_model(tmp_path / "w"))
