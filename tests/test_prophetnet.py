"""ProphetNet (models/prophetnet.py, objectives/prophetnet.py) against HF transformers
`ProphetNetForConditionalGeneration` (every stream's logits, the loss, import and export), the
future n-gram loss against a numpy computation, and prophetnet_tiny from the CLI with falling
held-out loss, one step equal on every mesh and a killed run that resumes bit for bit.

HF's full-sequence forward reads the predicting streams' relative position bias table in the
wrong order (transformers `ProphetNetNgramSelfAttention.get_predict_relative_pos_embeddings`
permutes the [T, ngram, heads] rows as [ngram, heads, T]); microsoft/ProphetNet's
`ngram_relative_logits` and HF's own one-token-at-a-time decoding do not. So the predicting
streams are compared with HF's cached decoding (stream 0) and with HF's forward whose
bias lookup is replaced by `reference_layout` (every stream, and the loss)."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity_utils import Parity, assert_close, assert_same_params, converted, random_model
from resilience_utils import (
    GRADIENT_STEP,
    abort_and_resume,
    assert_same_step_on_every_mesh,
    assert_same_training,
    mesh_overrides,
    run_in_process,
    small_corpus,
)

from pretext_jax import run
from pretext_jax.errors import UserError
from pretext_jax.models.hf import prophetnet as prophetnet_hf
from pretext_jax.models.prophetnet import ProphetNet
from pretext_jax.objectives.prophetnet import (
    ProphetNetLossSettings,
    check_prophetnet,
    ngram_loss,
    prepare_prophetnet,
)
from pretext_jax.pretrain import hf
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.trainer import Trainer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
modeling = transformers.models.prophetnet.modeling_prophetnet

# 3 streams, more decoder than encoder layers, different head counts and FFN widths, 8 buckets
# up to offset 12 (so the 19-token decoder input reaches the log-spaced and saturated buckets).
CONFIG = dict(vocab_size=99, hidden_size=32, num_encoder_layers=2, num_decoder_layers=3,
              num_encoder_attention_heads=4, num_decoder_attention_heads=2, encoder_ffn_dim=37,
              decoder_ffn_dim=41, max_position_embeddings=40, ngram=3, num_buckets=8,
              relative_max_distance=12, eps=0.1)


def reference_layout(self, hidden_states, attn_weights, position_ids, buckets):
    """The predicting streams' relative bias as microsoft/ProphetNet computes it: for stream s,
    head h, query t and key k, the query's `relative_pos_embeddings` row at bucket[t, k]."""
    del attn_weights, position_ids
    batch, length, ngram, _ = hidden_states.shape
    values = self.relative_pos_embeddings(hidden_states).view(
        batch, length, ngram, self.num_buckets, self.num_attn_heads)
    index = buckets[:, :, None, :, None].expand(
        batch, length, ngram, buckets.shape[-1], self.num_attn_heads).long()
    return torch.gather(values, 3, index).permute(0, 2, 4, 1, 3)  # [B, ngram, heads, T, K]


def batch(seed: int):
    """Encoder [3, 17] ids padded at the end of two rows, decoder [3, 19] ids, and labels with
    ignored (-100) positions."""
    rng = np.random.default_rng(seed)
    ids, dec = rng.integers(1, 99, (3, 17)), rng.integers(1, 99, (3, 19))
    mask = np.ones((3, 17), np.int64)
    mask[1, 11:], mask[2, 4:] = 0, 0
    labels = np.where(rng.random((3, 19)) < 0.7, rng.integers(1, 99, (3, 19)), -100)
    return ids * mask, mask, dec, labels


def hf_forward(model, ids, mask, dec, labels=None):
    """The encoder states, the main stream's logits, the [B, ngram, T, V] logits of the
    predicting streams and, with `labels`, the loss."""
    out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec,
                output_hidden_states=True, use_cache=False, labels=labels)
    outputs = {"encoder_hidden_states": out.encoder_last_hidden_state,
               "main_logits": model.lm_head(out.decoder_hidden_states[-1]),
               "ngram_logits": torch.cat([out.logits[:, None], out.logits_ngram], 1)}
    return outputs if labels is None else {**outputs, "loss": out.loss}


def hf_cached_decoding(model, ids, mask, dec):
    """HF's stream-0 logits [B, T, V] fed one decoder token at a time through its cache."""
    cache = transformers.EncoderDecoderCache(transformers.DynamicCache(),
                                             transformers.DynamicCache())
    steps = []
    with torch.no_grad():
        encoded = model.prophetnet.encoder(input_ids=torch.tensor(ids),
                                           attention_mask=torch.tensor(mask))
        for t in range(dec.shape[1]):
            out = model(encoder_outputs=encoded, attention_mask=torch.tensor(mask),
                        decoder_input_ids=torch.tensor(dec[:, t:t + 1]),
                        past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits[:, 0].numpy())
    return np.stack(steps, axis=1)


@nnx.jit
def _generation_logits(model, ids, mask, dec):
    return model.logits(model.decode(dec, model.encode(ids, mask), mask))


def our_forward(model, ids, mask, dec):
    out = model(ids, mask, dec)
    return {"encoder_hidden_states": out.encoder_hidden_states, "main_logits": out.logits,
            "ngram_logits": out.ngram_logits}


PROPHETNET = Parity("ProphetNetForConditionalGeneration", hf_forward, our_forward)


@pytest.mark.usefixtures("deterministic_torch")
def test_parity_with_hf_prophetnet_for_conditional_generation(tmp_path, monkeypatch):
    """Every output within 1e-5: the encoder and the main stream against HF's forward; every
    stream and HF's loss (labels given, eps 0.1) against HF's forward with the reference's
    bias layout. Loading warns about nothing, the in-memory state dict converts the same, and
    layers in a Python loop under remat compute the same."""
    reference = PROPHETNET.reference(1, **CONFIG)
    model = converted(reference, tmp_path)
    assert (model.config.ngram, model.config.num_decoder_layers) == (3, 3)
    ids, mask, dec, labels = batch(seed=2)
    ours = PROPHETNET.our_outputs(model, ids, mask, dec)
    theirs = PROPHETNET.hf_outputs(reference, ids, mask, dec)
    first = ("encoder_hidden_states", "main_logits")
    assert_close({name: ours[name] for name in first}, {name: theirs[name] for name in first})
    streams = ours["ngram_logits"]
    # HF's full-sequence predicting streams are not the reference's (the module docstring).
    assert np.abs(streams - theirs["ngram_logits"]).max() > 1e-2
    monkeypatch.setattr(modeling.ProphetNetNgramSelfAttention,
                        "get_predict_relative_pos_embeddings", reference_layout)
    expected = PROPHETNET.hf_outputs(reference, ids, mask, dec, labels)
    hf_loss = expected.pop("loss")
    assert_close(ours, expected)
    targets = jnp.asarray(np.where(labels < 0, 0, labels))
    loss, metrics = ngram_loss(jnp.asarray(streams), targets, ProphetNetLossSettings(
        label_smoothing=0.1, streams_within_span=False))
    np.testing.assert_allclose(float(loss), hf_loss, atol=1e-5, rtol=0)
    assert float(metrics["loss"][1]) == 3 * (labels >= 0).sum()
    state = {k: v.numpy() for k, v in reference.state_dict().items()}
    assert_same_params(hf.from_hf(reference.config.to_dict(), state), model)
    looped = hf.load(tmp_path, scan_layers=False, remat="full")
    np.testing.assert_allclose(PROPHETNET.our_outputs(looped, ids, mask, dec)["ngram_logits"],
                               streams, atol=1e-6)


@pytest.mark.usefixtures("deterministic_torch")
def test_stream_0_and_decode_are_hf_cached_decoding(tmp_path):
    """Stream 0 of the teacher-forced forward, and `logits(decode(...))` (the generation path:
    the main stream and stream 0 only), equal HF's logits fed one token at a time through its
    cache (HF's generation path) within 1e-5."""
    reference = PROPHETNET.reference(5, **CONFIG)
    model = converted(reference, tmp_path)
    ids, mask, dec, _ = batch(seed=6)
    cached = hf_cached_decoding(reference, ids, mask, dec)
    np.testing.assert_allclose(PROPHETNET.our_outputs(model, ids, mask, dec)["ngram_logits"][:, 0],
                               cached, atol=1e-5, rtol=0)
    generated = np.asarray(_generation_logits(model, *map(jnp.asarray, (ids, mask, dec))))
    np.testing.assert_allclose(generated, cached, atol=1e-5, rtol=0)
    assert model.config.decoder_start_token_id == 0 and model.config.eos_token_id == 2


@pytest.mark.usefixtures("deterministic_torch")
def test_our_prophetnet_round_trips_through_transformers(tmp_path, monkeypatch):
    """Export: transformers loads every tensor with nothing missing or unexpected and computes
    our logits (with the reference's bias layout); import gives our parameters back."""
    config = prophetnet_hf.config_from_hf(CONFIG | {"dropout": 0.2, "eos_token_id": 5})
    model = random_model(ProphetNet, config, 3)
    monkeypatch.setattr(modeling.ProphetNetNgramSelfAttention,
                        "get_predict_relative_pos_embeddings", reference_layout)
    ids, mask, dec, _ = batch(seed=4)
    reloaded, _ = PROPHETNET.round_trip(model, tmp_path / "exported", ids, mask, dec)
    assert reloaded.lm_head.weight is reloaded.prophetnet.word_embeddings.weight
    assert (reloaded.config.dropout, reloaded.config.eos_token_id) == (0.2, 5)
    with pytest.raises(UserError, match="pad_token_id"):
        prophetnet_hf.config_from_hf(CONFIG | {"pad_token_id": 1})


def numpy_ngram_loss(logits: np.ndarray, targets: np.ndarray, eps: float, within_span: bool,
                     only_first: bool) -> float:
    """The future n-gram loss term by term: stream s at position t predicts targets[t] (if
    any, and, within the span, if targets[t - s] is one too), smoothed by eps; the mean over
    every counted (stream, position)."""
    total, count = 0.0, 0
    batch, ngram, length, vocab = logits.shape
    for b in range(batch):
        for s in range(1 if only_first else ngram):
            for t in range(length):
                if targets[b, t] == 0 or (within_span and s and (t < s or targets[b, t - s] == 0)):
                    continue
                row = logits[b, s, t].astype(np.float64)
                log_p = row - row.max() - np.log(np.exp(row - row.max()).sum())
                total += (1 - eps) * -log_p[targets[b, t]] + eps / vocab * -log_p.sum()
                count += 1
    return total / count


@pytest.mark.parametrize("eps, within_span, only_first",
                         [(0.0, True, False), (0.1, True, False), (0.1, False, False),
                          (0.0, True, True)])
def test_ngram_loss_against_numpy(eps, within_span, only_first):
    """Spans of 1, 3 and 5 tokens (and a row without any) in rows of 9, 3 streams."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 3, 9, 11)).astype(np.float32) * 3
    targets = np.zeros((3, 9), np.int32)
    targets[0, 4], targets[1, 2:5], targets[2, 3:8] = 7, [1, 2, 3], [4, 5, 6, 7, 8]
    settings = ProphetNetLossSettings(label_smoothing=eps, streams_within_span=within_span,
                                      disable_ngram_loss=only_first)
    loss, metrics = ngram_loss(jnp.asarray(logits), jnp.asarray(targets), settings)
    expected = numpy_ngram_loss(logits, targets, eps, within_span, only_first)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    counted = 9 if only_first else (27 if not within_span else 9 + 6 + 4)
    assert float(metrics["loss"][1]) == counted
    assert float(metrics["next_token_loss"][1]) == 9


def test_settings_and_presets():
    """Segments must fit the positions (T + 1 for the predicting streams) and the decoder start
    must be MASS's; prophetnet_base is the paper's 16GB recipe."""
    tiny = make_config("prophetnet_tiny")
    model, examples = tiny.model, tiny.examples
    check_prophetnet(model, examples)
    for field, value, message in (("max_position_embeddings", 65, "max_position_embeddings"),
                                  ("decoder_start_token_id", 3, "decoder_start_token_id")):
        with pytest.raises(UserError, match=message):
            check_prophetnet(make_config("prophetnet_tiny", {f"model.{field}": value})
                             .model, examples)
    with pytest.raises(UserError, match="label_smoothing"):
        ProphetNetLossSettings(label_smoothing=1.0)
    bilingual = make_config("prophetnet_tiny", {"data.source": "en=a.txt,de=b.txt"})
    with pytest.raises(UserError, match="^ProphetNet has no language embeddings"):
        prepare_prophetnet(bilingual.data, examples, Path("unused"), 0)
    base = make_config("prophetnet_base")
    model, examples = base.model, base.examples
    assert (model.hidden_size, model.num_encoder_layers, model.num_decoder_layers,
            model.num_encoder_attention_heads, model.decoder_ffn_dim, model.ngram) == (
        1024, 12, 12, 16, 4096, 2)
    assert (examples.fragment_fraction, examples.fragment_at_start_prob,
            examples.mask_token_prob) == (0.15, 0.0, 0.8)
    # §4.1: 512-token inputs (510 + the two reserved positions) of packed sentences, a span
    # in every 64 tokens; fairseq's inverse_sqrt warmup from 1e-7.
    check_prophetnet(model, examples)
    assert (examples.max_seq_length, examples.pack_sentences, examples.fragment_block) == (
        510, True, 64)
    assert (base.optim.schedule, base.optim.warmup_init_learning_rate) == (
        "inverse_sqrt_warmup", 1e-7)
    assert (base.optim.learning_rate, base.train.batch_size, base.train.steps) == (
        3e-4, 1024, 500000)


# --- Training through the Trainer -----------------------------------------------------------

SHORT = {"model.hidden_size": 32, "model.num_encoder_attention_heads": 2,
         "model.num_decoder_attention_heads": 2, "model.encoder_ffn_dim": 64,
         "model.decoder_ffn_dim": 64, "examples.max_seq_length": 24, "data.vocab_size": 60,
         "train.batch_size": 16, "train.steps": 8, "train.log_every": 1,
         "train.eval_every": 1000, "train.eval_batches": 1, "train.checkpoint_every": 3,
         "train.progress": False}


def test_same_step_on_every_mesh(tmp_path):
    """One plain gradient step gives the same loss and parameters on one device and on the
    (2, 2, 2) mesh; the step moves the parameters."""
    data = small_corpus(tmp_path)

    def trainer_at(workdir, mesh, devices):
        return Trainer(make_config("prophetnet_tiny", {**SHORT, **data, **GRADIENT_STEP,
                                                 **mesh_overrides(mesh)}), workdir,
                       devices=devices)

    batch = assert_same_step_on_every_mesh(trainer_at, tmp_path)
    assert (np.asarray(batch["targets"]) != 0).sum() > 30


def test_killed_run_resumes_bit_for_bit(tmp_path):
    """Killed in place of step 5 (`abort_and_resume`: the step-3 checkpoint is the last),
    then a rerun: the same batches,
    losses and final parameters as an uninterrupted run."""
    overrides = {**SHORT, **small_corpus(tmp_path)}
    reference = tmp_path / "reference", tmp_path / "reference.log"
    run_in_process("prophetnet_tiny", overrides, *reference)
    ours_ = abort_and_resume("prophetnet_tiny", overrides, tmp_path, step=5)
    assert len(assert_same_training("prophetnet_tiny", overrides, ours_, reference)) > 8


def test_cli_trains_prophetnet_tiny_with_falling_held_out_loss(tmp_path):
    """`run.py pretrain --preset prophetnet_tiny --data FILE`: the held-out loss falls between
    the first and the last evaluation, to well below the uniform guess; `convert --to hf`
    writes a checkpoint and a tokenizer that transformers reads, the tokenizer ending a text
    with [SEP] as the records (and HF's ProphetNetTokenizer) do."""
    data = small_corpus(tmp_path)
    workdir = tmp_path / "run"
    settings = [f"{key}={value}" for key, value in {**SHORT, **data}.items()
                if key not in ("data.source", "train.steps", "train.eval_every",
                               "train.log_every")]
    assert run.main(["pretrain", "--preset", "prophetnet_tiny", "--data", data["data.source"],
                     "--workdir", str(workdir), *settings, "train.steps=40",
                     "train.eval_every=20", "train.log_every=10"]) == 0
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    evaluations = [row["loss"] for row in rows if row["split"] == "eval"]
    assert len(evaluations) == 2 and evaluations[-1] < evaluations[0] - 0.5, evaluations
    assert evaluations[-1] < np.log(60) - 1.0, evaluations
    assert run.main(["convert", str(workdir), str(tmp_path / "hf"), "--to", "hf"]) == 0
    reloaded = transformers.ProphetNetForConditionalGeneration.from_pretrained(tmp_path / "hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = tokenizer("Sentence 3 talks about topic 3").input_ids
    assert ids[-1] == reloaded.config.eos_token_id == tokenizer.sep_token_id
    assert tokenizer.cls_token_id not in ids
