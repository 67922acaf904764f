"""T5 (`models.t5`) against HF transformers `T5ForConditionalGeneration` (v1.0: ReLU, tied
embeddings; v1.1: gated GELU, untied LM head), T5's span corruption and BART's text infilling
against their definitions, Adafactor and the inverse square root schedule, and both objectives
trained through the Trainer on a mixed (2, 2, 2) mesh."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from parity_utils import Parity, assert_close, assert_same_params, converted, random_model

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import seq2seq as s2s
from pretext_jax.models.hf import t5 as t5_hf
from pretext_jax.models.layers import attention
from pretext_jax.models.t5 import T5, T5Config, shift_right
from pretext_jax.objectives.seq2seq import seq2seq_loss
from pretext_jax.pretrain import hf, optim
from pretext_jax.pretrain.config import OptimConfig, make_config
from pretext_jax.pretrain.trainer import Trainer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# v1.0: relu, tied, d_kv * heads != d_model, more decoder than encoder layers, 8 buckets up to
# offset 20 (so the 17-token batch reaches the log-spaced and the saturated buckets).
# v1.1: gated GELU, untied lm_head, 5 heads that do not divide d_model (as t5-v1_1-small).
CONFIGS = {
    "v1.0": dict(vocab_size=99, d_model=32, d_kv=6, d_ff=37, num_layers=2, num_decoder_layers=3,
                 num_heads=4, relative_attention_num_buckets=8,
                 relative_attention_max_distance=20, feed_forward_proj="relu",
                 tie_word_embeddings=True, decoder_start_token_id=0),
    "v1.1": dict(vocab_size=128, d_model=24, d_kv=8, d_ff=40, num_layers=2, num_heads=5,
                 feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                 layer_norm_epsilon=1e-5, initializer_factor=0.2, decoder_start_token_id=0),
}


def batch(vocab_size: int, seed: int):
    """Encoder [3, 17] and decoder [3, 11] ids, both padded at the end of two rows."""
    rng = np.random.default_rng(seed)
    ids, dec = rng.integers(1, vocab_size, (3, 17)), rng.integers(1, vocab_size, (3, 11))
    mask, dec_mask = np.ones((3, 17), np.int64), np.ones((3, 11), np.int64)
    mask[1, 11:], mask[2, 4:], dec_mask[0, 7:], dec_mask[2, 3:] = 0, 0, 0, 0
    return ids, mask, dec, dec_mask


def hf_outputs(model, ids, mask, dec, dec_mask):
    out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec,
                decoder_attention_mask=dec_mask)
    return {"encoder_hidden_states": out.encoder_last_hidden_state, "logits": out.logits}


def our_outputs(model, ids, mask, dec, dec_mask):
    out = model(ids, mask, dec, dec_mask)
    return {"encoder_hidden_states": out.encoder_hidden_states, "logits": out.logits}


T5_PARITY = Parity("T5ForConditionalGeneration", hf_outputs, our_outputs)


@pytest.mark.usefixtures("deterministic_torch")
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parity_with_hf_t5_for_conditional_generation(name, tmp_path):
    reference = T5_PARITY.reference(len(name), **CONFIGS[name])
    model = converted(reference, tmp_path)
    c = model.config
    assert (c.tie_word_embeddings, c.gated, c.inner_size) == (
        name == "v1.0", name == "v1.1", CONFIGS[name]["num_heads"] * CONFIGS[name]["d_kv"])
    inputs = batch(CONFIGS[name]["vocab_size"], seed=3)
    T5_PARITY.assert_parity(model, reference, *inputs)
    # The state dict in memory (tied copies included) converts the same way.
    state = {k: v.numpy() for k, v in reference.state_dict().items()}
    assert_same_params(hf.from_hf(reference.config.to_dict(), state), model)
    # Layers in a Python loop under remat compute the same (another program: float32 rounding
    # differs by up to 1.4e-6 here when XLA:CPU compiles at LLVM level 1, tests/conftest.py).
    looped = hf.load(tmp_path, scan_layers=False, remat="full")
    assert_close(T5_PARITY.our_outputs(looped, *inputs), T5_PARITY.our_outputs(model, *inputs),
                 atol=5e-6)
    # The objective's loss is HF's with labels: targets shifted right from 0, pads ignored.
    ids, mask, targets, target_mask = inputs
    ids, targets = ids * mask, targets * target_mask
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                             labels=torch.tensor(np.where(target_mask, targets, -100))).loss
    loss, metrics = seq2seq_loss(model, {"inputs": jnp.asarray(ids),
                                         "targets": jnp.asarray(targets)}, None)
    np.testing.assert_allclose(loss, expected.item(), atol=1e-5, rtol=0)
    assert metrics["loss"][1] == target_mask.sum() == metrics["target_tokens"][0]
    np.testing.assert_allclose(metrics["loss"][0] / metrics["loss"][1], expected.item(),
                               rtol=1e-5)


@pytest.mark.usefixtures("deterministic_torch")
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_our_t5_round_trips_through_transformers(name, tmp_path):
    hf_config = t5_hf.config_from_hf(CONFIGS[name] | {"dropout_rate": 0.2})
    ours = random_model(T5, hf_config, 5)
    reloaded, _ = T5_PARITY.round_trip(ours, tmp_path / "exported",
                                       *batch(CONFIGS[name]["vocab_size"], seed=4))
    assert (reloaded.lm_head.weight is reloaded.shared.weight) == (name == "v1.0")
    assert reloaded.config.dropout_rate == 0.2


def test_attention_bias_and_scale_on_the_dropout_path():
    """The einsum path (taken with attention dropout) adds the bias and uses the scale as the
    fused one does."""
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(key, (2, 5, 3, 4)) for key in keys[:3])
    bias = jax.random.normal(keys[3], (1, 3, 5, 5))
    mask = jnp.tril(jnp.ones((5, 5), bool))[None, None]

    @jax.jit
    def both(q, k, v, bias):
        return (attention(q, k, v, mask, 0.0, None, bias=bias, scale=1.0),
                attention(q, k, v, mask, 1e-12, jax.random.key(1), bias=bias, scale=1.0),
                attention(q, k, v, mask, 0.0, None))

    fused, explicit, plain = both(q, k, v, bias)
    np.testing.assert_allclose(fused, explicit, atol=1e-5)
    assert np.abs(np.asarray(fused - plain)).max() > 0.1


# --- Span corruption ------------------------------------------------------------------------


def resolve_sentinels(inputs: np.ndarray, targets: np.ndarray, vocab_size: int) -> list[int]:
    """The original text from T5's (inputs, targets): each sentinel of the inputs replaced by
    what follows the same sentinel in the targets."""
    is_sentinel = targets >= vocab_size - 100
    fills, current = {}, None
    for token in targets[:-1]:  # the final EOS
        if token >= vocab_size - 100:
            current = int(token)
            fills[current] = []
        else:
            fills[current].append(int(token))
    assert is_sentinel[0]
    return [t for token in inputs[:-1]
            for t in (fills[int(token)] if token >= vocab_size - 100 else [int(token)])]


def test_random_spans_helper_gives_exact_lengths():
    assert s2s.random_spans_helper(512, 0.15, 3.0) == (568, 114)  # T5's numbers
    rng = np.random.default_rng(0)
    for inputs_length in (16, 33, 64, 100, 128, 512, 1024):
        raw, targets_length = s2s.random_spans_helper(inputs_length, 0.15, 3.0)
        config = s2s.Seq2SeqExampleConfig(inputs_length=inputs_length)
        assert (config.raw_length, config.targets_length) == (raw, targets_length)
        for _ in range(20):
            tokens = rng.integers(5, 1000, raw)
            inputs, targets = s2s.span_corruption(tokens, config, 32100, 3, rng)
            assert (len(inputs), len(targets)) == (inputs_length, targets_length)
        # One more raw token would not fit.
        noise = round((raw + 1) * 0.15)
        assert raw + 1 - noise + round(noise / 3) + 1 > inputs_length


def test_span_corruption_small_case_by_hand():
    tokens = np.arange(10, 20)
    mask = np.array([0, 0, 1, 1, 0, 0, 0, 1, 0, 0], bool)
    assert s2s.noise_span_to_unique_sentinel(tokens, mask, 99).tolist() == [
        10, 11, 99, 14, 15, 16, 98, 18, 19]
    assert s2s.noise_span_to_unique_sentinel(tokens, ~mask, 99).tolist() == [
        99, 12, 13, 98, 17, 97]


def test_span_corruption_reconstructs_and_counts_sentinels_down():
    rng = np.random.default_rng(1)
    config, vocab_size = s2s.Seq2SeqExampleConfig(), 1100
    for length in (568, 300, 57, 9, 2):
        tokens = rng.integers(5, 1000, length)
        inputs, targets = s2s.span_corruption(tokens, config, vocab_size, 3, rng)
        assert inputs[-1] == targets[-1] == 3
        assert resolve_sentinels(inputs, targets, vocab_size) == tokens.tolist()
        spans = s2s.span_counts(length, 0.15, 3.0)[1]
        expected = list(range(vocab_size - 1, vocab_size - 1 - spans, -1))
        assert inputs[inputs >= 1000].tolist() == expected
        assert targets[targets >= 1000].tolist() == expected


def test_random_spans_noise_mask_statistics():
    rng = np.random.default_rng(2)
    noise_fractions, span_lengths = [], []
    for _ in range(2000):
        mask = s2s.random_spans_noise_mask(568, 0.15, 3.0, rng)
        starts = np.flatnonzero(mask & ~np.concatenate([[False], mask[:-1]]))
        ends = np.flatnonzero(mask & ~np.concatenate([mask[1:], [False]]))
        assert mask.sum() == 85 and len(starts) == 28 and not mask[0]  # exact counts
        noise_fractions.append(mask.mean())
        span_lengths.extend(ends - starts + 1)
    span_lengths = np.asarray(span_lengths)
    assert abs(np.mean(noise_fractions) - 0.15) < 0.001
    assert abs(span_lengths.mean() - 85 / 28) < 1e-9
    # Random segmentation: every composition of 85 into 28 parts equally likely, so a span has
    # length 1 with probability C(83, 26) / C(84, 27) = 27 / 84.
    assert abs(np.mean(span_lengths == 1) - 27 / 84) < 0.01
    # Noise is spread along the sequence (no end of it favoured).
    masks = np.stack([s2s.random_spans_noise_mask(568, 0.15, 3.0, rng) for _ in range(2000)])
    thirds = [part.mean() for part in np.array_split(masks, 3, axis=1)]
    assert max(abs(t - 0.15) for t in thirds) < 0.01, thirds
    # Over varied lengths the noise density and mean span length hold on average.
    lengths = rng.integers(20, 600, 2000)
    noise = [s2s.random_spans_noise_mask(n, 0.15, 3.0, rng).sum() for n in lengths]
    spans = [s2s.span_counts(n, 0.15, 3.0)[1] for n in lengths]
    assert abs(np.sum(noise) / lengths.sum() - 0.15) < 0.002
    assert abs(np.sum(noise) / np.sum(spans) - 3.0) < 0.05


# --- Text infilling -------------------------------------------------------------------------


def test_poisson_span_lengths():
    table = s2s.poisson_probabilities(3.0)
    np.testing.assert_allclose(table[:4], [math.exp(-3) * 3**k / math.factorial(k)
                                           for k in range(4)], rtol=1e-6)
    rng = np.random.default_rng(3)
    draws = []
    for budget in rng.integers(1, 200, 3000):
        lengths = s2s.sample_span_lengths(int(budget), table, rng)
        assert lengths.sum() == budget and (lengths >= 0).all()
        draws.extend(lengths[:-1])  # the last one is cut to the budget
    draws = np.asarray(draws)
    assert abs(draws.mean() - 3.0) < 0.05 and abs(np.mean(draws == 0) - math.exp(-3)) < 0.005


def test_text_infilling_against_its_definition():
    rng = np.random.default_rng(4)
    config = s2s.Seq2SeqExampleConfig(noise="text_infilling", inputs_length=128)
    mask_id, eos = 4, 3
    word_start = rng.random(1000) < 0.7
    word_start[eos] = True
    fractions = []
    for _ in range(300):
        tokens = np.append(rng.integers(5, 1000, 511), eos)
        out = s2s.text_infilling(tokens, word_start[tokens], mask_id, config, 1000, rng)
        # One mask token per span, one per 0-length span; the rest of the text in order.
        assert (out.source == mask_id).sum() == out.spans + out.inserted
        assert out.source[out.source != mask_id].tolist() == tokens[~out.masked].tolist()
        assert out.source[-1] == eos and not out.masked[-1]
        # Whole words: a masked run starts at a word start and stops before one (or EOS).
        run_starts = np.flatnonzero(out.masked & ~np.concatenate([[False], out.masked[:-1]]))
        run_ends = np.flatnonzero(out.masked & ~np.concatenate([out.masked[1:], [False]]))
        assert word_start[tokens[run_starts]].all() and word_start[tokens[run_ends + 1]].all()
        words = word_start[tokens[:-1]]
        fractions.append((out.masked[:-1] & words).sum() / words.sum())
    # 30% of the words are chosen; overlapping spans (as in fairseq) mask a little less.
    assert 0.25 < np.mean(fractions) <= 0.3, np.mean(fractions)


def test_noised_examples_have_fixed_shapes_and_the_text_as_target():
    vocab = s2s.Seq2SeqVocab(text_vocab_size=1000, vocab_size=1100, eos_id=3, mask_id=4,
                             continuation=np.zeros(1000, bool))
    rng = np.random.default_rng(5)
    for noise in s2s.NOISES:
        config = s2s.Seq2SeqExampleConfig(noise=noise, inputs_length=64)
        full = rng.integers(5, 1000, config.raw_length).astype(np.int32)
        short = np.concatenate([full[:20], np.zeros(config.raw_length - 20, np.int32)])
        for tokens in (full, short):
            example = s2s.noise_example(tokens, vocab, config, rng)
            assert example["inputs"].shape == (64,)
            assert example["targets"].shape == (config.targets_length,)
            length = int((tokens != 0).sum())
            if noise == "text_infilling":
                assert example["targets"][:length + 1].tolist() == [*tokens[:length], 3]
            elif length == config.raw_length:
                assert (example["inputs"] != 0).all() and (example["targets"] != 0).all()
    with pytest.raises(UserError, match="extra_ids"):
        s2s.Seq2SeqExampleConfig(inputs_length=512, extra_ids=20)
    with pytest.raises(UserError, match="examples.noise"):
        s2s.Seq2SeqExampleConfig(noise="deshuffle")


# --- Optimizer ------------------------------------------------------------------------------


def test_inverse_sqrt_schedule_and_per_layer_adafactor():
    schedule = optim.learning_rate_schedule(
        OptimConfig(schedule="inverse_sqrt", learning_rate=0.01, warmup_steps=10_000), 2**19)
    np.testing.assert_allclose([schedule(n) for n in (0, 5000, 10_000, 40_000, 2**19)],
                               [0.01, 0.01, 0.01, 0.005, 1 / math.sqrt(2**19)], rtol=1e-6)
    # A stacked [layers, ...] parameter gets exactly the updates of one Adafactor per layer.
    rng = np.random.default_rng(6)
    params = {"layers": {"kernel": jnp.asarray(rng.normal(size=(3, 130, 140)), jnp.float32)},
              "embedding": jnp.asarray(rng.normal(size=(150, 129)), jnp.float32)}
    tx = optim.make_optimizer(OptimConfig(optimizer="adafactor", schedule="inverse_sqrt",
                                          learning_rate=0.01, weight_decay=0.0, clip_norm=0.0),
                              100)
    one = optax.adafactor(optim.inverse_sqrt_schedule(0.01, 100))
    state = tx.init(params)
    singles = [one.init(params["layers"]["kernel"][i]) for i in range(3)]
    update, update_one = jax.jit(tx.update), jax.jit(one.update)
    for _ in range(2):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
        updates, state = update(grads, state, params)
        for i in range(3):
            expected, singles[i] = update_one(grads["layers"]["kernel"][i], singles[i],
                                              params["layers"]["kernel"][i])
            np.testing.assert_allclose(updates["layers"]["kernel"][i], expected, rtol=1e-5,
                                       atol=1e-8)


# --- Training through the Trainer -----------------------------------------------------------

TRAIN = ["train.log_every=10", "train.progress=false", "data.vocab_size=1000",
         "train.batch_size=32", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]


def train(preset: str, workdir, steps: int, extra: list[str] = ()) -> list[float]:
    config = make_config(preset, [f"train.steps={steps}", f"train.eval_every={steps}",
                                  f"train.checkpoint_every={steps}", *TRAIN, *extra])
    Trainer(config, workdir).run()
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if row["split"] == "train"], rows


def test_span_corruption_then_text_infilling_train_on_a_mixed_mesh(tmp_path):
    losses, rows = train("t5_tiny", tmp_path / "t5", 40)
    assert len(losses) == 4 and losses[-1] < losses[0] - 1.0, losses
    evaluation = [row for row in rows if row["split"] == "eval"][-1]
    assert evaluation["loss"] < losses[0] - 1.0 and evaluation["target_tokens"] > 13
    model = json.loads((tmp_path / "t5" / "model.json").read_text())["model"]
    assert model["vocab_size"] == 1100 and model["eos_token_id"] == 3  # + 100 sentinels
    # BART's text infilling on the same model, with the tokenizer trained above.
    tokenizer = next((tmp_path / "t5").rglob("tokenizer-*.model"))
    losses, _ = train("bart_tiny", tmp_path / "bart", 12,
                      [f"data.tokenizer={tokenizer}", "train.log_every=4"])
    assert losses[-1] < losses[0] - 0.5, losses


def test_shift_right_and_presets():
    targets = jnp.asarray([[7, 8, 9, 0], [5, 6, 0, 0]])
    assert shift_right(targets).tolist() == [[0, 7, 8, 9], [0, 5, 6, 0]]
    assert T5Config(feed_forward_proj="gated-gelu").activation == "gelu_tanh"
    base = make_config("t5_base")
    examples, model = base.examples, base.model
    assert (examples.raw_length, examples.inputs_length, examples.targets_length) == (
        568, 512, 114)
    assert (model.hidden_size, model.intermediate_size, model.num_layers, model.decoder_layers,
            model.num_heads, model.head_size, model.activation, model.tie_word_embeddings) == (
        768, 3072, 12, 12, 12, 64, "relu", True)
    assert (base.optim.optimizer, base.train.steps, base.train.batch_size) == (
        "adafactor", 2**19, 128)
    assert make_config("bart_tiny").examples.noise == "text_infilling"
