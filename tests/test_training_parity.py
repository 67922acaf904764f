"""Training parity: the trainer's own compiled step (`Trainer._train_step`: sharded over 8 fake
devices, the method's loss, the optax chain) run for four steps on fixed batches against an
independent torch step written from the original repositories' optimizers and losses, on the
HF transformers model holding the same initial weights (exported by `pretrain.hf`), in float32
with dropout off.

Each family compares the per-step losses and the final parameters with one helper,
`max_relative_difference` (max |ours - reference| / (|reference| + 0.1) over every loss and
parameter entry, i.e. `np.allclose` with rtol = the value and atol = value / 10), asserted
<= 1e-5 for the faithful reference. Negative controls change one detail of the reference and
assert the same number exceeds 1e-4, so the comparison can see that detail.

- BERT (google-research/bert optimization.py, run_pretraining.py): AdamWeightDecay without
  bias correction, decay not on LayerNorm/bias, eps 1e-6, global-norm clip 1.0, warmup then
  linear decay from step 0; MLM + mean NSP loss. Controls: bias correction, decay on
  LayerNorm/bias, the schedule one step late, no clipping.
- ELECTRA (electra model/optimization.py, run_pretraining.py): the same optimizer with
  ELECTRA's schedule (decay times warmup ramp), generator MLM + 50 x RTD with shared
  embeddings; the generator's samples use our step's Gumbel noise (`sampling_noise`).
  Control: BERT's schedule.
- RoBERTa (fairseq optim/adam.py, lr_scheduler/polynomial_decay_schedule.py,
  criterions/masked_lm.py): Adam with eps before the bias correction, decay on every
  parameter, no clipping, warmup then linear decay from the peak; mean MLM loss. Controls:
  torch's eps placement, no decay on LayerNorm/bias, BERT's schedule.
- GPT (GPT-1 §4.1; torch.optim.AdamW): bias-corrected AdamW with decoupled decay not on biases
  and gains, torch's gradient clipping, warmup then cosine. Control: torch.optim.Adam's L2
  (coupled) decay.
- T5 (Mesh TensorFlow optimize.py `AdafactorOptimizer`, learning_rate_schedules.py
  `truncated_rsqrt`), per layer on stacked parameters. Control: HF transformers' Adafactor
  with T5's settings, which factors every matrix. The loss is HF's mean over target tokens,
  as pretext's objective; Mesh TF's adds a z-loss of 1e-4 and divides by the targets' size.
- SimCLR (simclr tf2/lars_optimizer.py, objective.py, model.py): LARS with classic momentum,
  no decay or adaptation on BatchNorm and biases, NT-Xent, warmup then cosine, BatchNorm
  over the global batch (ours sharded over 8 devices, torch's over the whole batch). The
  views are ours (`augmented_views`). Controls: LARS on BatchNorm too; BatchNorm per device.
- ALBERT (albert lamb_optimizer.py, optimization.py): LAMB = AdamWeightDecay's update times
  the trust ratio ||w|| / ||update||, neither decay nor trust ratio on LayerNorm and biases,
  BERT's schedule, clip 1.0; MLM + mean SOP. Controls: the trust ratio on LayerNorm and biases
  too, Adam's bias correction (both optax.lamb's).
- ELMo (bilm-tf training.py; no HF class: the char CNN, highway and LSTMP stacks re-stated in
  torch on our initial parameters): Adagrad with initial accumulator 1 on the gradient of
  unroll_steps (20) x the loss, global-norm clip 10, the sampled softmax with our step's
  candidates (`elmo_candidates`). Controls: no loss scale, TF's default accumulator 0.1, no
  clipping. Also the preset's stateful streams, each direction's LSTM states carried from
  batch to batch as bilm-tf's `train` feeds them (control: from zero every batch).
- MoCo v2 (moco builder.py, main_moco.py): torch.optim.SGD with momentum and decay on every
  parameter, the key encoder's momentum update before the keys, shuffled keys with BatchNorm
  per group, the queue; our views and shuffle. Controls: no momentum update, keys enqueued
  before the loss.
- BYOL (byol byol_experiment.py, utils/optimizers.py): LARS with the rate applied after the
  momentum, the cosine target-EMA update after each step, the symmetric regression loss.
  Controls: no target update, SimCLR's momentum placement.
- XLNet (xlnet model_utils.py, function_builder.py): AdamWeightDecay that decays the
  r_w/r_r/r_s biases too, warmup then poly decay from the peak, clip 1.0; the two-stream loss
  with our perm_mask and the memory carried between steps. Controls: those biases not decayed,
  BERT's schedule.
- wav2vec 2.0 (fairseq wav2vec2.py, criterions/wav2vec_criterion.py, optim/adam.py):
  Wav2Vec2ForPreTraining with fairseq's GradMultiply (feature_grad_mult 0.1) and features_pen
  added by a hook, our masks, distractors and Gumbel noise (`wav2vec2_run`) at the annealed
  temperature; contrastive + 0.1 diversity + 10 feature penalty per masked frame, fairseq's
  Adam and polynomial schedule. Controls: no gradient scaling, no feature penalty.

Forward-computed states that a step carries (MoCo's queue of keys, XLNet's memory) are compared
within STATE_TOLERANCE (`state_parity`), the losses and parameters within TOLERANCE.

The torch models drop `padding_idx` from their embeddings (`tf_embeddings`): TF gives the
padding row a gradient like any other, and ELECTRA's generator can sample the padding token.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx

from bench.throughput import masked_lm_batch, synthetic_batch
from pretext_jax.objectives.registry import PreparedData
from pretext_jax.pretrain import hf
from pretext_jax.pretrain.config import Config, make_config
from pretext_jax.pretrain.trainer import Trainer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("deterministic_torch")

STEPS = 4
TOLERANCE = 1e-5
CONTROL_MINIMUM = 1e-4
FLOOR = 0.1  # |a - b| <= 1e-5 (|b| + 0.1): rtol 1e-5, atol 1e-6
# Carried forward states (MoCo's keys, XLNet's memory): the outputs of a deep forward pass whose
# float32 rounding alone reaches a few 1e-5 in this measure (MoCo's notes).
STATE_TOLERANCE = 3e-4


# ------------------------------------------------------------------------------- comparison
def max_relative_difference(ours: Mapping[str, np.ndarray],
                            reference: Mapping[str, np.ndarray]) -> float:
    """max |a - b| / (|b| + FLOOR) over every entry of every array `reference` names (`ours`
    must hold the same names and shapes): <= r exactly when np.allclose(a, b, rtol=r,
    atol=r * FLOOR) holds for all of them."""
    assert set(ours) == set(reference), sorted(set(ours) ^ set(reference))
    worst = 0.0
    for name, expected in reference.items():
        actual = np.asarray(ours[name], np.float64)
        expected = np.asarray(expected, np.float64)
        assert actual.shape == expected.shape, name
        worst = max(worst, float(np.max(np.abs(actual - expected) / (np.abs(expected) + FLOOR))))
    return worst


def state_parity(ours: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray],
                 states: tuple[str, ...]) -> tuple[float, float]:
    """`max_relative_difference` over the losses and parameters, and separately over `states`:
    model state that forward passes compute and the step carries (MoCo's queue of keys, XLNet's
    memory), compared within STATE_TOLERANCE (see the families' notes)."""
    def part(state: Mapping[str, np.ndarray], inside: bool) -> dict[str, np.ndarray]:
        return {k: v for k, v in state.items() if (k in states) == inside}

    return (max_relative_difference(part(ours, False), part(reference, False)),
            max_relative_difference(part(ours, True), part(reference, True)))


def difference_to(label: str, ours: Mapping[str, np.ndarray],
                  reference: Mapping[str, np.ndarray]) -> float:
    """`max_relative_difference`, printed after `label` (`pytest -s` shows every number)."""
    difference = max_relative_difference(ours, reference)
    print(f"{label}: {difference:.2e}")
    return difference


def with_losses(losses: list[float], params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One flat dict of the per-step losses and the final parameters, for the comparison."""
    return {**{f"loss/{i}": np.float64(v) for i, v in enumerate(losses)}, **params}


# ----------------------------------------------------------------------------------- pretext
def make_trainer(preset: str, overrides: list[str], workdir: Path) -> Trainer:
    """The preset with `overrides`, a trainer without records (nothing is written; we feed the
    compiled step ourselves, as bench/throughput.py does)."""
    config = make_config(preset, [*overrides, "train.progress=false", "mesh.data=8"])
    return Trainer(config, workdir / "unused", data=PreparedData(train=None, eval=None))


def hf_state(model: nnx.Module) -> dict[str, np.ndarray]:
    """`model`'s parameters under their HF names (copies: the trainer donates its state); a
    joint model (ELECTRA) as `part/name`."""
    parts = model.parts() if hasattr(model, "parts") else {"": model}
    return {f"{part}/{name}" if part else name: np.array(value, copy=True)
            for part, one in parts.items() for name, value in hf.to_hf(one)[1].items()}


def run_ours(trainer: Trainer, batches: list[dict[str, np.ndarray]],
             export: Callable[[nnx.Module], dict[str, np.ndarray]] = hf_state
             ) -> tuple[nnx.Module, dict[str, np.ndarray]]:
    """The initial model (for the reference) and our per-step losses + final parameters
    (`export`ed), from the trainer's compiled step on `batches`."""
    state = trainer.init_state()
    initial = jax.tree.map(lambda x: np.array(x, copy=True), nnx.merge(
        trainer.graphdef, jax.device_get(state.params), jax.device_get(state.model_state)))
    losses = []
    for batch in batches:
        state, metrics = trainer._train_step(state, trainer.to_global(batch))
        total, count = jax.device_get(metrics["loss"])
        losses.append(float(total / count))
    final = nnx.merge(trainer.graphdef, state.params, state.model_state)
    return initial, with_losses(losses, export(final))


def family_run(preset: str, overrides: list[str], workdir: Path,
               make_batches: Callable[[Config], list[dict[str, np.ndarray]]],
               export: Callable[[nnx.Module], dict[str, np.ndarray]] = hf_state,
               exported_part: Callable[[nnx.Module], nnx.Module] | None = lambda model: model
               ) -> dict[str, Any]:
    """Our run of `preset` + `overrides` on `make_batches(config)`, with the initial weights
    (of `exported_part(model)`; None: no HF class, the reference reads `initial`) saved as a
    HF checkpoint in `workdir/hf` for the reference."""
    trainer = make_trainer(preset, overrides, workdir)
    batches = make_batches(trainer.config)
    initial, ours = run_ours(trainer, batches, export)
    if exported_part is not None:
        hf.save(exported_part(initial), workdir / "hf")
    return {"ours": ours, "batches": batches, "hf": workdir / "hf", "config": trainer.config,
            "trainer": trainer, "initial": initial}


def batches_for(config: Config, count: int | None = None) -> list[dict[str, np.ndarray]]:
    """`count` (default STEPS) masked-LM batches of `config` (bench/throughput.py's, made by
    the method's own masking code), seeds 0, 1, ..., with two rows cut short by padding."""
    return [padded(synthetic_batch(config, seed), {1: 15, 5: 9})
            for seed in range(count or STEPS)]


def padded(batch: dict[str, np.ndarray], lengths: dict[int, int]) -> dict[str, np.ndarray]:
    """Row r of a masked-LM batch cut to lengths[r] tokens: padding (id 0, mask 0, segment 0)
    after it, and its predictions there turned into padding predictions (position 0, id 0,
    weight 0), as the references' features pad."""
    batch = {k: v.copy() for k, v in batch.items()}
    for row, length in lengths.items():
        for key in ("input_ids", "input_mask", "segment_ids"):
            batch[key][row, length:] = 0
        cut = batch["masked_lm_positions"][row] >= length
        for key in ("masked_lm_positions", "masked_lm_ids", "masked_lm_weights"):
            batch[key][row, cut] = 0
    return batch


def masked_lm_batches(config: Config, finish: Callable[[dict[str, np.ndarray],
                                                         np.random.Generator], None]
                      ) -> list[dict[str, np.ndarray]]:
    """STEPS of bench/throughput.py's masked-LM batches for a method it has no synthetic batch
    for (one rng, seed 0), two rows padded (`padded`), each changed in place by
    `finish(batch, rng)`."""
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(STEPS):
        batch = padded(masked_lm_batch(config, config.train.batch_size, rng), {1: 15, 5: 9})
        finish(batch, rng)
        batches.append(batch)
    return batches


# ------------------------------------------------------------------------- torch references
def tf_clip_by_global_norm(grads: list[Any], clip_norm: float) -> None:
    """tf.clip_by_global_norm: g * clip_norm / max(global_norm, clip_norm), in place."""
    norm = torch.sqrt(sum(torch.sum(g * g) for g in grads))
    scale = clip_norm / torch.maximum(norm, torch.tensor(clip_norm))
    for g in grads:
        g.mul_(scale)


def bert_learning_rate(step: int, peak: float, warmup: int, total: int) -> float:
    """google-research/bert optimization.py `create_optimizer`: polynomial_decay(power 1, end 0)
    of the pre-increment global step, replaced by peak * step / warmup while step < warmup."""
    decayed = peak * (1.0 - min(step, total) / total)
    return peak * step / warmup if step < warmup else decayed


def electra_learning_rate(step: int, peak: float, warmup: int, total: int) -> float:
    """google-research/electra model/optimization.py `create_optimizer`: the same decay,
    multiplied by min(1, step / warmup)."""
    return peak * (1.0 - min(step, total) / total) * min(1.0, step / warmup)


def loss_and_gradients(named: list[tuple[str, Any]], loss_fn: Callable[[int], Any],
                       step: int) -> float:
    """Clears the gradients of `named`, runs the step's loss backward; returns the loss."""
    for _, p in named:
        p.grad = None
    loss = loss_fn(step)
    loss.backward()
    return float(loss.detach())


@dataclasses.dataclass(frozen=True)
class AdamWeightDecayReference:
    """AdamWeightDecayOptimizer of google-research/bert (and electra) optimization.py:
    m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2, update = m / (sqrt(v) + eps), plus
    weight_decay * w unless the variable name matches LayerNorm / layer_norm / bias,
    w -= lr * update; gradients clipped to global norm 1.0 first. `layer_adaptation`: the
    LAMBOptimizer of google-research/albert lamb_optimizer.py, the same update times the trust
    ratio ||w|| / ||update|| (1 if either is 0) on the variables the decay takes (its
    exclude_from_layer_adaptation defaults to exclude_from_weight_decay). `clip_norm` 0,
    `bias_correction`, `decay_everything` and `adapt_everything` are the negative controls'
    departures; `include_in_decay` XLNet's addition."""

    weight_decay: float
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-6
    clip_norm: float = 1.0
    bias_correction: bool = False
    decay_everything: bool = False
    layer_adaptation: bool = False
    adapt_everything: bool = False
    include_in_decay: tuple[str, ...] = ()

    @staticmethod
    def excluded(name: str) -> bool:
        return any(word in name for word in ("LayerNorm", "layer_norm", "bias"))

    def decays(self, name: str) -> bool:
        """Not on LayerNorm and biases, unless the name matches `include_in_decay` (xlnet
        model_utils.py's include_in_weight_decay: r_s_bias, r_r_bias, r_w_bias)."""
        return (self.decay_everything or any(word in name for word in self.include_in_decay)
                or not self.excluded(name))

    def adapts(self, name: str) -> bool:
        return self.layer_adaptation and (self.adapt_everything or not self.excluded(name))

    def run(self, named: list[tuple[str, Any]], loss_fn: Callable[[int], Any],
            learning_rate: Callable[[int], float], steps: int) -> list[float]:
        """`steps` updates of the parameters `named` (name, tensor) on `loss_fn(step)`."""
        params = [p for _, p in named]
        m = [torch.zeros_like(p) for p in params]
        v = [torch.zeros_like(p) for p in params]
        losses = []
        for step in range(steps):
            losses.append(loss_and_gradients(named, loss_fn, step))
            grads = [p.grad.detach().clone() for p in params]
            if self.clip_norm:
                tf_clip_by_global_norm(grads, self.clip_norm)
            lr = learning_rate(step)
            with torch.no_grad():
                for (name, p), g, m_i, v_i in zip(named, grads, m, v, strict=True):
                    m_i.mul_(self.b1).add_((1 - self.b1) * g)
                    v_i.mul_(self.b2).add_((1 - self.b2) * g * g)
                    if self.bias_correction:
                        update = (m_i / (1 - self.b1 ** (step + 1))) / (
                            torch.sqrt(v_i / (1 - self.b2 ** (step + 1))) + self.eps)
                    else:
                        update = m_i / (torch.sqrt(v_i) + self.eps)
                    if self.weight_decay and self.decays(name):
                        update = update + self.weight_decay * p
                    if self.adapts(name):
                        w_norm, u_norm = torch.linalg.norm(p), torch.linalg.norm(update)
                        if w_norm > 0 and u_norm > 0:
                            update = update * (w_norm / u_norm)
                    p.sub_(lr * update)
        return losses


def tf_embeddings(model: Any) -> Any:
    """`model` with torch's `padding_idx` taken off its embeddings: HF zeroes the gradient of
    the padding row of a lookup, TF's embedding lookup (the references') does not, and
    ELECTRA's generator may sample the padding token into the discriminator's input."""
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            module.padding_idx = None
    return model


def unique_parameters(*models: Any) -> list[tuple[str, Any]]:
    """(name, parameter) of every distinct parameter of `models` (tied ones once)."""
    seen, named = set(), []
    for model in models:
        for name, p in model.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                named.append((name, p))
    return named


def torch_state(model: Any, prefix: str = "") -> dict[str, np.ndarray]:
    return {prefix + name: value.detach().numpy().copy()
            for name, value in model.state_dict().items()}


def long(x: np.ndarray) -> Any:
    return torch.tensor(np.asarray(x), dtype=torch.long)


def log_softmax_nll(logits: Any, labels: Any) -> Any:
    """-log softmax(logits)[label] with the one-hot sum of the TF references."""
    log_probs = torch.log_softmax(logits, dim=-1)
    one_hot = torch.nn.functional.one_hot(labels, logits.shape[-1]).to(log_probs.dtype)
    return -torch.sum(log_probs * one_hot, dim=-1)


def gather(sequence: Any, positions: np.ndarray) -> Any:
    """run_pretraining.py `gather_indexes`: [B, T, ...] at [B, P] positions."""
    index = long(positions)
    return sequence[torch.arange(sequence.shape[0])[:, None], index]


# --------------------------------------------------------------------------------------- BERT
# Learning rate 3e-3: larger rates make a tiny model's few steps chaotic enough that float32
# rounding grows past 1e-5. Weight decay 0.1 instead of the references' 0.01 (the formula is
# theirs): decaying the LayerNorm scales (1.0) then moves them by 0.1 lr per step, which the
# comparison sees within four steps.
MASKED_LM = ["model.vocab_size=120", "model.hidden_size=32", "model.num_heads=2",
             "model.intermediate_size=64", "model.max_position_embeddings=32",
             "examples.max_seq_length=24", "examples.max_predictions_per_seq=5",
             "train.batch_size=8", "train.steps=10", "optim.warmup_steps=2",
             "optim.learning_rate=3e-3", "optim.bias_correction=false",
             "optim.weight_decay=0.1", "optim.eps=1e-6", "optim.clip_norm=1.0"]
BERT = [*MASKED_LM, "optim.schedule=linear"]


@pytest.fixture(scope="module")
def bert_run(tmp_path_factory) -> dict[str, Any]:
    return family_run("bert_tiny", BERT, tmp_path_factory.mktemp("bert"), batches_for)


def bert_reference(run: dict[str, Any], optimizer: AdamWeightDecayReference,
                   learning_rate: Callable[[int], float], architecture: str = "BertForPreTraining",
                   pair_logits: str = "seq_relationship_logits") -> dict[str, np.ndarray]:
    """BertForPreTraining (or `architecture`, whose sentence-pair head gives `pair_logits`)
    trained by run_pretraining.py's loss: MLM sum(w nll) / (sum(w) + 1e-5) over the gathered
    positions plus the mean NSP (ALBERT: SOP) loss."""
    model = tf_embeddings(getattr(transformers, architecture).from_pretrained(run["hf"]).eval())
    batches = run["batches"]

    def loss_fn(step: int) -> Any:
        b = batches[step]
        out = model(input_ids=long(b["input_ids"]), token_type_ids=long(b["segment_ids"]),
                    attention_mask=long(b["input_mask"]))
        logits = gather(out.prediction_logits, b["masked_lm_positions"])
        weights = torch.tensor(b["masked_lm_weights"])
        nll = log_softmax_nll(logits, long(b["masked_lm_ids"]))
        mlm = torch.sum(weights * nll) / (torch.sum(weights) + 1e-5)
        nsp = torch.mean(log_softmax_nll(getattr(out, pair_logits),
                                         long(b["next_sentence_labels"]).reshape(-1)))
        return mlm + nsp

    losses = optimizer.run(unique_parameters(model), loss_fn, learning_rate, len(batches))
    return with_losses(losses, {k: v for k, v in torch_state(model).items()
                                if k in run["ours"]})


def adam_weight_decay(config: Config, **changes: Any) -> AdamWeightDecayReference:
    return AdamWeightDecayReference(config.optim.weight_decay, config.optim.b1, config.optim.b2,
                                    config.optim.eps, config.optim.clip_norm, **changes)


def bert_schedule(config: Config, offset: int = 0) -> Callable[[int], float]:
    o = config.optim
    return lambda step: bert_learning_rate(step + offset, o.learning_rate, o.warmup_steps,
                                           config.train.steps)


def test_bert_trains_as_google_research_bert(bert_run):
    reference = bert_reference(bert_run, adam_weight_decay(bert_run["config"]),
                               bert_schedule(bert_run["config"]))
    assert difference_to("bert", bert_run["ours"], reference) <= TOLERANCE


@pytest.mark.parametrize("control", ["bias_correction", "decay_layer_norm_and_bias",
                                     "schedule_one_step_late", "no_clipping"])
def test_bert_negative_controls(bert_run, control):
    optimizer = adam_weight_decay(bert_run["config"])
    schedule = bert_schedule(bert_run["config"])
    if control == "bias_correction":
        optimizer = dataclasses.replace(optimizer, bias_correction=True)
    elif control == "decay_layer_norm_and_bias":
        optimizer = dataclasses.replace(optimizer, decay_everything=True)
    elif control == "schedule_one_step_late":
        schedule = bert_schedule(bert_run["config"], offset=1)
    else:
        optimizer = dataclasses.replace(optimizer, clip_norm=0.0)
    reference = bert_reference(bert_run, optimizer, schedule)
    assert difference_to(f"bert {control}", bert_run["ours"], reference) > CONTROL_MINIMUM


# ------------------------------------------------------------------------------------ ELECTRA
ELECTRA = [*MASKED_LM, "model.embedding_size=16", "model.generator_hidden_size=0.25",
           "optim.schedule=electra_linear"]


@pytest.fixture(scope="module")
def electra_run(tmp_path_factory) -> dict[str, Any]:
    run = family_run("electra_tiny", ELECTRA, tmp_path_factory.mktemp("electra"), batches_for)
    vocab_size = run["initial"].config.vocab_size
    run["noise"] = [sampling_noise(run["trainer"], step, vocab_size,
                                   batch["masked_lm_positions"].shape)
                    for step, batch in enumerate(run["batches"])]
    return run


def sampling_noise(trainer: Trainer, step: int, vocab_size: int,
                   shape: tuple[int, ...]) -> np.ndarray:
    """The Gumbel noise our step `step` draws for the generator's samples, recomputed on the
    host from the same key: the trainer's step key fold_in(key(seed), step), split in three by
    `electra_loss`, the third for sampling. Giving the reference the same noise makes its
    Gumbel-max samples (argmax(logits / temperature + noise), pretrain_helpers.py
    `sample_from_softmax`) the same tokens as ours, so both train on the same replaced tokens;
    the noise's own distribution is tested in tests/test_electra.py."""
    from pretext_jax.models.encoder import split_rng
    from pretext_jax.objectives.electra import gumbel_noise

    key = jax.random.fold_in(jax.random.key(trainer.config.train.seed), step)
    return np.asarray(gumbel_noise(split_rng(key, 3)[2], (*shape, vocab_size)))


def scatter_update(sequence: Any, updates: Any, positions: np.ndarray) -> tuple[Any, Any]:
    """pretrain_helpers.py `scatter_update` on ids: `updates` [B, P] written at `positions`,
    never at position 0 (where padding predictions point); returns (sequence, updated mask)."""
    index = long(positions)
    rows = torch.arange(sequence.shape[0])[:, None].expand_as(index)
    mask = torch.zeros_like(sequence)
    mask[rows, index] = 1
    mask[:, 0] = 0
    written = sequence.clone()
    written[rows, index] = updates
    return torch.where(mask > 0, written, sequence), mask


def electra_reference(run: dict[str, Any], optimizer: AdamWeightDecayReference,
                      learning_rate: Callable[[int], float]) -> dict[str, np.ndarray]:
    """ElectraForMaskedLM (generator) + ElectraForPreTraining (discriminator) sharing one
    embeddings module, trained by electra run_pretraining.py's loss: generator MLM
    sum(w nll) / (sum(w) + 1e-6), Gumbel-max samples (no gradient) written into the unmasked
    input, label = sampled != original, discriminator sigmoid cross-entropy averaged over
    input_mask with epsilon 1e-6, total = 1 x MLM + 50 x RTD."""
    objective = run["config"].objective
    generator = tf_embeddings(
        transformers.ElectraForMaskedLM.from_pretrained(run["hf"] / "generator").eval())
    discriminator = tf_embeddings(transformers.ElectraForPreTraining.from_pretrained(
        run["hf"] / "discriminator").eval())
    shared = discriminator.electra.embeddings
    for name, value in generator.electra.embeddings.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), shared.state_dict()[name].numpy())
    generator.electra.embeddings = shared  # one set of embeddings, as the reference's scope
    generator.generator_lm_head.weight = shared.word_embeddings.weight
    batches = run["batches"]

    def loss_fn(step: int) -> Any:
        b = batches[step]
        inputs = {"token_type_ids": long(b["segment_ids"]),
                  "attention_mask": long(b["input_mask"])}
        logits = gather(generator(input_ids=long(b["input_ids"]), **inputs).logits,
                        b["masked_lm_positions"])
        weights = torch.tensor(b["masked_lm_weights"])
        nll = log_softmax_nll(logits, long(b["masked_lm_ids"]))
        mlm = torch.sum(weights * nll) / (torch.sum(weights) + 1e-6)
        noise = torch.tensor(run["noise"][step])
        sampled = torch.argmax(logits.detach() / objective.temperature + noise, dim=-1)
        original, _ = scatter_update(long(b["input_ids"]), long(b["masked_lm_ids"]),
                                     b["masked_lm_positions"])
        fake, masked = scatter_update(original, sampled, b["masked_lm_positions"])
        labels = (masked * (fake != original)).to(torch.float32)
        rtd_logits = discriminator(input_ids=fake, **inputs).logits
        mask = inputs["attention_mask"].to(torch.float32)
        bce = torch.nn.functional.binary_cross_entropy_with_logits(
            rtd_logits, labels, reduction="none") * mask
        rtd = torch.sum(bce) / (1e-6 + torch.sum(mask))
        return objective.generator_weight * mlm + objective.discriminator_weight * rtd

    losses = optimizer.run(unique_parameters(discriminator, generator), loss_fn, learning_rate,
                           len(batches))
    state = {**torch_state(discriminator, "discriminator/"),
             **torch_state(generator, "generator/")}
    return with_losses(losses, {k: v for k, v in state.items() if k in run["ours"]})


def electra_schedule(config: Config, learning_rate: Callable[..., float] = electra_learning_rate
                     ) -> Callable[[int], float]:
    o = config.optim
    return lambda step: learning_rate(step, o.learning_rate, o.warmup_steps, config.train.steps)


def test_electra_trains_as_google_research_electra(electra_run):
    reference = electra_reference(electra_run, adam_weight_decay(electra_run["config"]),
                                  electra_schedule(electra_run["config"]))
    assert difference_to("electra", electra_run["ours"], reference) <= TOLERANCE


def test_electra_negative_control_bert_schedule(electra_run):
    """BERT's warmup (peak * step / warmup) instead of ELECTRA's ramp times the decay."""
    reference = electra_reference(electra_run, adam_weight_decay(electra_run["config"]),
                                  electra_schedule(electra_run["config"], bert_learning_rate))
    difference = difference_to("electra with BERT's schedule", electra_run["ours"], reference)
    assert difference > CONTROL_MINIMUM


# ---------------------------------------------------------------------------------------- GPT
# eps 1e-6, not gpt_tiny's 1e-8: the attention key bias has a zero gradient up to rounding
# (a softmax ignores a shift shared by all keys), and bias-corrected Adam with eps 1e-8 turns
# that float32 noise (~1e-9) into steps of about lr in both implementations, independently.
GPT = ["model.vocab_size=120", "model.hidden_size=32", "model.num_heads=2",
       "model.intermediate_size=64", "model.max_position_embeddings=32", "model.eos_token_id=1",
       "examples.max_seq_length=24", "train.batch_size=8", "train.steps=10",
       "optim.warmup_steps=2", "optim.learning_rate=3e-3", "optim.schedule=cosine",
       "optim.bias_correction=true", "optim.eps=1e-6", "optim.weight_decay=0.1",
       "optim.clip_norm=1.0"]


def gpt_batches(config: Config) -> list[dict[str, np.ndarray]]:
    """Blocks of max_seq_length + 1 random tokens; two rows end in padding (mask 0, id 0)."""
    rng = np.random.default_rng(0)
    length = config.examples.max_seq_length + 1
    batches = []
    for _ in range(STEPS):
        tokens = rng.integers(1, config.model.vocab_size, (config.train.batch_size, length))
        mask = np.ones_like(tokens)
        mask[1, 16:], mask[5, 9:] = 0, 0
        batches.append({"tokens": (tokens * mask).astype(np.int32),
                        "token_mask": mask.astype(np.int32)})
    return batches


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory) -> dict[str, Any]:
    return family_run("gpt_tiny", GPT, tmp_path_factory.mktemp("gpt"), gpt_batches)


def cosine_learning_rate(step: int, peak: float, warmup: int, total: int) -> float:
    """GPT-1 §4.1 (which GPT-2 keeps): linear warmup from 0, then cosine annealing to 0."""
    if step < warmup:
        return peak * step / warmup
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(step - warmup, total - warmup)
                                        / (total - warmup)))


def gpt_reference(run: dict[str, Any], coupled_decay: bool = False) -> dict[str, np.ndarray]:
    """GPT2LMHeadModel trained with torch.optim.AdamW (bias-corrected, decoupled decay on
    every weight but biases and LayerNorm gains: GPT-1 §4.1), torch's clip_grad_norm_ at 1.0,
    on the mean next-token cross-entropy over non-padding targets. `coupled_decay` (the
    negative control): torch.optim.Adam's L2 decay, added to the gradient."""
    model = tf_embeddings(transformers.GPT2LMHeadModel.from_pretrained(run["hf"]).eval())
    config, batches = run["config"], run["batches"]
    o = config.optim
    named = unique_parameters(model)
    decayed = [p for n, p in named if not n.endswith("bias") and ".ln_" not in n]
    others = [p for n, p in named if n.endswith("bias") or ".ln_" in n]
    assert len(decayed) + len(others) == len(named) and others
    groups = [{"params": decayed, "weight_decay": o.weight_decay},
              {"params": others, "weight_decay": 0.0}]
    optimizer = (torch.optim.Adam if coupled_decay else torch.optim.AdamW)(
        groups, lr=o.learning_rate, betas=(o.b1, o.b2), eps=o.eps)
    losses = []
    for step, b in enumerate(batches):
        optimizer.zero_grad()
        tokens, mask = long(b["tokens"]), torch.tensor(b["token_mask"], dtype=torch.float32)
        logits = model(input_ids=tokens[:, :-1], attention_mask=mask[:, :-1].long()).logits
        nll = log_softmax_nll(logits, tokens[:, 1:])
        loss = torch.sum(nll * mask[:, 1:]) / torch.sum(mask[:, 1:])
        loss.backward()
        losses.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_([p for _, p in named], o.clip_norm)
        for group in optimizer.param_groups:
            group["lr"] = cosine_learning_rate(step, o.learning_rate, o.warmup_steps,
                                               config.train.steps)
        optimizer.step()
    return with_losses(losses, {k: v for k, v in torch_state(model).items() if k in run["ours"]})


def test_gpt_trains_as_torch_adamw(gpt_run):
    reference = gpt_reference(gpt_run)
    assert difference_to("gpt", gpt_run["ours"], reference) <= TOLERANCE


def test_gpt_negative_control_coupled_weight_decay(gpt_run):
    reference = gpt_reference(gpt_run, coupled_decay=True)
    difference = difference_to("gpt with L2 (coupled) decay", gpt_run["ours"], reference)
    assert difference > CONTROL_MINIMUM


# ------------------------------------------------------------------------------------ RoBERTa
ROBERTA = [o for o in MASKED_LM if not o.startswith(("optim.bias_correction", "optim.clip"))] + [
    "model.max_position_embeddings=32", "optim.schedule=linear_from_peak", "optim.b2=0.98",
    "optim.bias_correction=true", "optim.eps_before_bias_correction=true",
    "optim.decay_norms_and_biases=true", "optim.clip_norm=0.0"]


def roberta_batches(config: Config) -> list[dict[str, np.ndarray]]:
    """`masked_lm_batches` (one segment type). BERT's masking may draw the padding id as a
    random token; fairseq's never draws a special token, and both RoBERTas treat that id as
    padding (positions, zero gradient in fairseq), so such draws become another word here."""

    def no_stray_padding(batch: dict[str, np.ndarray], _: np.random.Generator) -> None:
        stray = (batch["input_ids"] == 0) & (batch["input_mask"] > 0)
        batch["input_ids"][stray] = 5

    return masked_lm_batches(config, no_stray_padding)


@pytest.fixture(scope="module")
def roberta_run(tmp_path_factory) -> dict[str, Any]:
    return family_run("roberta_tiny", ROBERTA, tmp_path_factory.mktemp("roberta"),
                      roberta_batches)


def fairseq_learning_rate(step: int, peak: float, warmup: int, total: int) -> float:
    """fairseq polynomial_decay_schedule.py `step_update(num_updates)` with power 1 and end 0;
    the trainer calls step_update(0) before the first update, so update n uses n."""
    if warmup > 0 and step <= warmup:
        return step / warmup * peak
    if step >= total:
        return 0.0
    return peak * (1 - (step - warmup) / (total - warmup))


@dataclasses.dataclass(frozen=True)
class FairseqAdamReference:
    """fairseq/optim/adam.py `Adam.step`: m, v moments, p -= weight_decay lr p on every
    parameter the trainer gives it (all of them), p -= lr sqrt(1 - b2^t) / (1 - b1^t) m /
    (sqrt(v) + eps); no gradient clipping (--clip-norm 0). Negative controls: torch's AdamW
    eps (after the bias correction), or BERT's exclusion of LayerNorm and biases from decay."""

    weight_decay: float
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-6
    torch_eps: bool = False
    skip_norms_and_biases: bool = False

    def run(self, named: list[tuple[str, Any]], loss_fn: Callable[[int], Any],
            learning_rate: Callable[[int], float], steps: int) -> list[float]:
        b1, b2 = self.betas
        m = [torch.zeros_like(p) for _, p in named]
        v = [torch.zeros_like(p) for _, p in named]
        losses = []
        for step in range(steps):
            losses.append(loss_and_gradients(named, loss_fn, step))
            lr, t = learning_rate(step), step + 1
            with torch.no_grad():
                for (name, p), m_i, v_i in zip(named, m, v, strict=True):
                    m_i.mul_(b1).add_((1 - b1) * p.grad)
                    v_i.mul_(b2).add_((1 - b2) * p.grad * p.grad)
                    if self.torch_eps:
                        step_size = lr / (1 - b1 ** t)
                        denominator = torch.sqrt(v_i) / math.sqrt(1 - b2 ** t) + self.eps
                    else:
                        step_size = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
                        denominator = torch.sqrt(v_i) + self.eps
                    skip = self.skip_norms_and_biases and ("LayerNorm" in name
                                                           or "bias" in name)
                    if not skip:
                        p.sub_(self.weight_decay * lr * p)
                    p.sub_(step_size * m_i / denominator)
        return losses


def fairseq_adam(config: Config) -> FairseqAdamReference:
    o = config.optim
    return FairseqAdamReference(o.weight_decay, (o.b1, o.b2), o.eps)


def roberta_reference(run: dict[str, Any], optimizer: FairseqAdamReference,
                      learning_rate: Callable[..., float] = fairseq_learning_rate
                      ) -> dict[str, np.ndarray]:
    """RobertaForMaskedLM (fairseq's RoBERTa in HF's layout, padding_idx kept as fairseq's
    embeddings have it) on fairseq criterions/masked_lm.py's loss: the summed cross-entropy of
    the masked tokens divided by their number (the trainer's sample_size normalisation)."""
    model = transformers.RobertaForMaskedLM.from_pretrained(run["hf"]).eval()
    config, batches = run["config"], run["batches"]

    def loss_fn(step: int) -> Any:
        b = batches[step]
        logits = model(input_ids=long(b["input_ids"]),
                       attention_mask=long(b["input_mask"])).logits
        weights = torch.tensor(b["masked_lm_weights"])
        nll = log_softmax_nll(gather(logits, b["masked_lm_positions"]), long(b["masked_lm_ids"]))
        return torch.sum(weights * nll) / torch.sum(weights)

    o = config.optim
    losses = optimizer.run(unique_parameters(model), loss_fn,
                           lambda step: learning_rate(step, o.learning_rate, o.warmup_steps,
                                                      config.train.steps),
                           len(batches))
    return with_losses(losses, {k: v for k, v in torch_state(model).items() if k in run["ours"]})


def test_roberta_trains_as_fairseq(roberta_run):
    reference = roberta_reference(roberta_run, fairseq_adam(roberta_run["config"]))
    assert difference_to("roberta", roberta_run["ours"], reference) <= TOLERANCE


@pytest.mark.parametrize("control", ["torch_adamw_eps", "no_decay_on_norms_and_biases",
                                     "bert_schedule"])
def test_roberta_negative_controls(roberta_run, control):
    optimizer, schedule = fairseq_adam(roberta_run["config"]), fairseq_learning_rate
    if control == "torch_adamw_eps":
        optimizer = dataclasses.replace(optimizer, torch_eps=True)
    elif control == "no_decay_on_norms_and_biases":
        optimizer = dataclasses.replace(optimizer, skip_norms_and_biases=True)
    else:
        schedule = bert_learning_rate
    reference = roberta_reference(roberta_run, optimizer, schedule)
    assert difference_to(f"roberta {control}", roberta_run["ours"], reference) > CONTROL_MINIMUM


# ----------------------------------------------------------------------------------------- T5
# d_model 128 with 4 x 32 heads and vocabulary 160: the embedding and attention matrices have
# two dims >= 128 and get factored second moments, the 128 x 64 feed-forward matrices, the
# relative position tables and the norms do not, so both of Adafactor's branches run.
# warmup_steps 2: the inverse square root schedule decays from the third step on.
T5 = ["model.vocab_size=160", "model.hidden_size=128", "model.num_heads=4", "model.head_size=32",
      "model.intermediate_size=64", "model.eos_token_id=1", "train.batch_size=8",
      "train.steps=10", "optim.warmup_steps=2", "optim.learning_rate=0.01"]


def t5_batches(config: Config) -> list[dict[str, np.ndarray]]:
    """Random inputs [8, 20] and targets [8, 8] (ids 2..159), padded (0) in some rows."""
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(STEPS):
        inputs = rng.integers(2, 160, (config.train.batch_size, 20))
        targets = rng.integers(2, 160, (config.train.batch_size, 8))
        inputs[1, 12:], inputs[4, 7:], targets[1, 5:], targets[6, 3:] = 0, 0, 0, 0
        batches.append({"inputs": inputs.astype(np.int32), "targets": targets.astype(np.int32)})
    return batches


@pytest.fixture(scope="module")
def t5_run(tmp_path_factory) -> dict[str, Any]:
    return family_run("t5_tiny", T5, tmp_path_factory.mktemp("t5"), t5_batches)


def inverse_sqrt_learning_rate(step: int, peak: float, warmup: int) -> float:
    """Mesh TensorFlow learning_rate_schedules.py `truncated_rsqrt`, rsqrt(max(step,
    warmup)) of the pre-increment global step, scaled so that its value before `warmup` is
    `peak` (T5: peak 0.01 = rsqrt(10^4))."""
    return peak * math.sqrt(warmup) / math.sqrt(max(step, warmup))


class MeshAdafactorReference:
    """Mesh TensorFlow optimize.py `AdafactorOptimizer` as T5 trains with it (defaults:
    multiply_by_parameter_scale, beta1 0, clipping_threshold 1, factored with
    min_dim_size_to_factor 128, epsilon1 1e-30, epsilon2 1e-3, decay rate
    1 - (step + 1)^-0.8), one variable per layer as Mesh TF holds them."""

    min_dim_size_to_factor = 128

    @staticmethod
    def rms(x: Any) -> Any:
        return torch.sqrt(torch.mean(x * x))

    def factored_dims(self, shape: tuple[int, ...]) -> tuple[int, int] | None:
        """The two largest dims (largest first), if the second is >= min_dim_size_to_factor."""
        if len(shape) < 2:
            return None
        order = sorted(range(len(shape)), key=lambda d: -shape[d])
        if shape[order[1]] < self.min_dim_size_to_factor:
            return None
        return order[0], order[1]

    def run(self, named: list[tuple[str, Any]], loss_fn: Callable[[int], Any],
            learning_rate: Callable[[int], float], steps: int) -> list[float]:
        slots: dict[str, Any] = {}
        losses = []
        for step in range(steps):
            losses.append(loss_and_gradients(named, loss_fn, step))
            decay = 1.0 - (step + 1.0) ** -0.8
            lr = learning_rate(step)
            with torch.no_grad():
                for name, p in named:
                    grad = p.grad
                    grad_squared = grad * grad + 1e-30
                    update_scale = torch.clamp(self.rms(p), min=1e-3) * lr
                    dims = self.factored_dims(tuple(p.shape))
                    if dims:
                        d0, d1 = dims
                        vr = slots.get(name + "/vr", 0.0) * decay + (1 - decay) * torch.mean(
                            grad_squared, dim=d0)
                        vc = slots.get(name + "/vc", 0.0) * decay + (1 - decay) * torch.mean(
                            grad_squared, dim=d1)
                        slots[name + "/vr"], slots[name + "/vc"] = vr, vc
                        long_term_mean = torch.mean(vr, dim=d1 - (d1 > d0), keepdim=True)
                        r_factor = torch.rsqrt(vr / long_term_mean).unsqueeze(d0)
                        c_factor = torch.rsqrt(vc).unsqueeze(d1)
                        x = grad * r_factor * c_factor
                    else:
                        v = slots.get(name + "/v", 0.0) * decay + (1 - decay) * grad_squared
                        slots[name + "/v"] = v
                        x = grad * torch.rsqrt(v)
                    x = x / torch.clamp(self.rms(x) / 1.0, min=1.0)
                    p.sub_(x * update_scale)
        return losses


class HFAdafactorReference:
    """transformers.optimization.Adafactor with Mesh TF's settings (scale_parameter,
    relative_step False with the schedule's lr, warmup_init False, clip_threshold 1.0,
    decay_rate -0.8, beta1 None, weight_decay 0): it factors the second moment of every
    matrix, where Mesh TF (and optax) only factor those whose two largest dims are >= 128."""

    def run(self, named: list[tuple[str, Any]], loss_fn: Callable[[int], Any],
            learning_rate: Callable[[int], float], steps: int) -> list[float]:
        from transformers.optimization import Adafactor

        optimizer = Adafactor([p for _, p in named], lr=learning_rate(0), eps=(1e-30, 1e-3),
                              clip_threshold=1.0, decay_rate=-0.8, beta1=None,
                              weight_decay=0.0, scale_parameter=True, relative_step=False,
                              warmup_init=False)
        losses = []
        for step in range(steps):
            losses.append(loss_and_gradients(named, loss_fn, step))
            optimizer.param_groups[0]["lr"] = learning_rate(step)
            optimizer.step()
        return losses


def t5_reference(run: dict[str, Any], optimizer: Any) -> dict[str, np.ndarray]:
    """T5ForConditionalGeneration (v1.0, tied embeddings) on the teacher-forced cross-entropy
    averaged over non-padding target tokens (HF's loss, which pretext's objective follows;
    Mesh TF's adds a z-loss of 1e-4 and divides by the targets' size, see the module notes),
    trained by `optimizer` with the inverse square root schedule."""
    model = tf_embeddings(transformers.T5ForConditionalGeneration.from_pretrained(
        run["hf"]).eval())
    config, batches = run["config"], run["batches"]

    def loss_fn(step: int) -> Any:
        b = batches[step]
        inputs, targets = long(b["inputs"]), long(b["targets"])
        decoder_inputs = torch.cat([torch.zeros_like(targets[:, :1]), targets[:, :-1]], 1)
        logits = model(input_ids=inputs, attention_mask=(inputs != 0).long(),
                       decoder_input_ids=decoder_inputs).logits
        labels = torch.where(targets != 0, targets, -100)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 labels.reshape(-1), ignore_index=-100)

    o = config.optim
    losses = optimizer.run(unique_parameters(model), loss_fn,
                           lambda step: inverse_sqrt_learning_rate(step, o.learning_rate,
                                                                   o.warmup_steps),
                           len(batches))
    return with_losses(losses, {k: v for k, v in torch_state(model).items() if k in run["ours"]})


def test_t5_trains_as_mesh_tensorflow_adafactor(t5_run):
    """Our per-layer Adafactor on stacked parameters against Mesh TF's, variable by
    variable."""
    reference = t5_reference(t5_run, MeshAdafactorReference())
    assert difference_to("t5", t5_run["ours"], reference) <= TOLERANCE


def test_t5_negative_control_factoring_every_matrix(t5_run):
    reference = t5_reference(t5_run, HFAdafactorReference())
    difference = difference_to("t5 with HF's Adafactor (every matrix factored)",
                               t5_run["ours"], reference)
    assert difference > CONTROL_MINIMUM


# ------------------------------------------------------------------------------------- SimCLR
# A narrow ResNet-10 (one basic block a stage: the step's rules are those of any depth, at half
# the compiling) with the ImageNet stem (HF ResNetModel has no CIFAR stem) on 32 px images,
# 16 images = 32 views over the 8 devices, LARS with warmup then cosine. The step sizes are
# chosen for a well-conditioned comparison: the BatchNorm parameters take plain momentum-SGD
# steps (lr x gradient, gradients ~3 at initialisation), and at lr >= 0.01 a few such steps
# make this tiny network's gradients so sensitive that float32 rounding (3e-5 here in torch
# alone, float32 against float64) grows past 1e-4 within four steps in either implementation.
# At lr 0.003 the layer-wise steps are lr x trust_coefficient of each kernel's norm, so the
# trust coefficient is 0.3 (SimCLR: 0.001) for them to show, and weight decay 0.03 (SimCLR:
# 1e-4 or 1e-6) for the decay to matter against the gradients; the formulas are the reference's.
LARS_STEPS = ["train.batch_size=16", "train.steps=10", "optim.warmup_steps=2",
              "optim.learning_rate=0.003", "optim.weight_decay=0.03", "optim.momentum=0.9",
              "optim.trust_coefficient=0.3"]
SIMCLR = ["model.stem=imagenet", "model.depth=10", "model.base_width=4", "model.projection_dim=16",
          *LARS_STEPS]


def image_batches(config: Config) -> list[dict[str, np.ndarray]]:
    """Images that differ in colour and in a smooth pattern, plus noise. (Pure noise images
    all pool to nearly the same features, and the head's BatchNorm then divides by a tiny
    spread: float32 itself is off by 3e-5 there, in torch as in JAX.)"""
    rng = np.random.default_rng(0)
    size, count = 32, config.train.batch_size
    grid = np.linspace(0.0, 1.0, size)
    batches = []
    for _ in range(STEPS):
        colour = rng.uniform(0, 255, (count, 1, 1, 3))
        angle = rng.uniform(0, 2 * np.pi, (count, 1, 1, 1))
        frequency = rng.uniform(1, 4, (count, 1, 1, 1))
        wave = np.sin(2 * np.pi * frequency * (np.cos(angle) * grid[None, :, None, None]
                                               + np.sin(angle) * grid[None, None, :, None]))
        images = colour + 60 * wave + rng.normal(0, 20, (count, size, size, 3))
        batches.append({"image": np.clip(images, 0, 255).astype(np.uint8),
                         "label": np.zeros(count, np.int32)})
    return batches


@pytest.fixture(scope="module")
def simclr_run(tmp_path_factory) -> dict[str, Any]:
    run = family_run("simclr_tiny", SIMCLR, tmp_path_factory.mktemp("simclr"), image_batches,
                     export=simclr_state, exported_part=lambda model: model.backbone)
    run["views"] = [augmented_views(run["trainer"], step, batch["image"])
                    for step, batch in enumerate(run["batches"])]
    return run


def resnet_state(backbone: nnx.Module, prefix: str = "resnet.") -> dict[str, np.ndarray]:
    """A ResNet's parameters under HF names (ResNetModel's, after `prefix`), BatchNorm
    statistics left out: they are not trained, and torch keeps an unbiased running variance."""
    return {prefix + k.removeprefix("resnet."): np.array(v, copy=True)
            for k, v in hf.to_hf(backbone)[1].items()
            if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))}


def simclr_state(model: nnx.Module) -> dict[str, np.ndarray]:
    """The backbone's parameters under HF names (`resnet_state`) and the head's under the
    names of `TorchSimCLR`'s."""
    state = resnet_state(model.backbone)
    for i, layer in enumerate(model.head):
        state[f"head.{i}.dense.weight"] = np.array(layer.dense.kernel[...]).T
        state[f"head.{i}.normalization.weight"] = np.array(layer.normalization.scale[...])
        if layer.normalization.bias is not None:
            state[f"head.{i}.normalization.bias"] = np.array(layer.normalization.bias[...])
    return state


def step_key(trainer: Trainer, step: int) -> jax.Array:
    """The key our step `step` hands the loss: fold_in(key(seed), step)."""
    return jax.random.fold_in(jax.random.key(trainer.config.train.seed), step)


def augmented_views(trainer: Trainer, step: int, images: np.ndarray,
                    key_of: Callable[[jax.Array], jax.Array] = lambda key: key) -> np.ndarray:
    """The two views our step `step` makes of `images` [N, H, W, 3], [2N, ...] (first views,
    then second), recomputed on the host with `objectives.common.two_view.two_views` and
    `key_of` the step's key (the loss's own split of it): the augmentations are ours, tested
    in tests/test_image_augment.py; here the reference trains on the same pixels."""
    from pretext_jax.objectives.common.two_view import two_views

    views = trainer.objective.view_augmentations
    first, second = jax.jit(lambda k, x: two_views(k, x, views))(
        key_of(step_key(trainer, step)), images)
    return np.concatenate([np.asarray(first), np.asarray(second)])


class ScaleOnlyBatchNorm(torch.nn.Module):
    """BatchNorm with a scale and no offset (`center=False`), the projection head's last."""

    def __init__(self, scale: np.ndarray, epsilon: float):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(len(scale), eps=epsilon, affine=False)
        self.weight = torch.nn.Parameter(torch.tensor(scale))

    def forward(self, x: Any) -> Any:
        return self.norm(x) * self.weight


class TorchSimCLR(torch.nn.Module):
    """HF ResNetModel + SimCLR's projection head (tf2/model.py `ProjectionHead`: dense without
    bias, BatchNorm, ReLU; the last BatchNorm without offset) holding `initial`'s head
    weights, BatchNorm in training mode over the whole batch of 2N views."""

    def __init__(self, backbone: Any, initial: nnx.Module):
        super().__init__()
        self.backbone = backbone
        self.head = torch.nn.ModuleList()
        for layer in initial.head:
            scale = np.array(layer.normalization.scale[...])
            epsilon = layer.normalization.epsilon
            module = torch.nn.Module()
            module.dense = torch_linear(layer.dense)
            module.normalization = (ScaleOnlyBatchNorm(scale, epsilon)
                                    if layer.normalization.bias is None
                                    else torch_batch_norm(layer.normalization))
            self.head.append(module)

    def forward(self, views: Any) -> Any:
        x = self.backbone(pixel_values=views.permute(0, 3, 1, 2)).pooler_output.flatten(1)
        for i, module in enumerate(self.head):
            x = module.normalization(module.dense(x))
            if i < len(self.head) - 1:
                x = torch.relu(x)
        return x


def torch_linear(layer: nnx.Module) -> Any:
    """torch.nn.Linear holding an nnx.Linear's kernel (transposed) and bias, if it has one."""
    kernel = np.array(layer.kernel[...])
    linear = torch.nn.Linear(*kernel.shape, bias=layer.bias is not None)
    linear.weight.data = torch.tensor(kernel.T.copy())
    if layer.bias is not None:
        linear.bias.data = torch.tensor(np.array(layer.bias[...]))
    return linear


def torch_batch_norm(norm: nnx.Module) -> Any:
    """torch.nn.BatchNorm1d holding an nnx.BatchNorm's scale, offset and epsilon."""
    module = torch.nn.BatchNorm1d(norm.num_features, eps=norm.epsilon)
    module.weight.data = torch.tensor(np.array(norm.scale[...]))
    module.bias.data = torch.tensor(np.array(norm.bias[...]))
    return module


def nt_xent_reference(projections: Any, temperature: float) -> Any:
    """simclr tf2/objective.py `add_contrastive_loss`: l2-normalised halves, logits against
    the other view (positive on the diagonal) and the same view (self masked by 1e9), softmax
    cross-entropy both ways, mean over images of the sum."""
    hidden = projections * torch.rsqrt(torch.clamp(
        torch.sum(projections * projections, -1, keepdim=True), min=1e-12))
    first, second = torch.chunk(hidden, 2)
    n = first.shape[0]
    mask = torch.eye(n) * 1e9
    aa = first @ first.T / temperature - mask
    bb = second @ second.T / temperature - mask
    ab = first @ second.T / temperature
    ba = second @ first.T / temperature
    labels = torch.arange(n)
    loss_a = torch.nn.functional.cross_entropy(torch.cat([ab, aa], 1), labels, reduction="none")
    loss_b = torch.nn.functional.cross_entropy(torch.cat([ba, bb], 1), labels, reduction="none")
    return torch.mean(loss_a + loss_b)


@dataclasses.dataclass(frozen=True)
class LarsReference:
    """google-research/simclr tf2/lars_optimizer.py `LARSOptimizer` with classic momentum:
    g += wd w and trust = eeta ||w|| / ||g|| (1 if either norm is 0) except for variables
    whose name has batch_normalization or bias (here: normalization, bias), v = m v + lr trust
    g, w -= v. `adapt_everything`: the negative control, decay and trust ratio everywhere."""

    weight_decay: float
    momentum: float = 0.9
    eeta: float = 0.001
    adapt_everything: bool = False
    learning_rate_after_momentum: bool = False

    def excluded(self, name: str) -> bool:
        return not self.adapt_everything and ("normalization" in name or "bias" in name)

    def run(self, named: list[tuple[str, Any]], loss_fn: Callable[[int], Any],
            learning_rate: Callable[[int], float], steps: int,
            after_update: Callable[[int], None] = lambda step: None) -> list[float]:
        """`learning_rate_after_momentum`: deepmind byol utils/optimizers.py `lars` instead,
        v = m v + trust g (with the same decay and exclusions), w -= lr v. `after_update(step)`
        runs after each update (BYOL's target update)."""
        velocity = [torch.zeros_like(p) for _, p in named]
        losses = []
        for step in range(steps):
            losses.append(loss_and_gradients(named, loss_fn, step))
            lr = learning_rate(step)
            with torch.no_grad():
                for (name, p), v in zip(named, velocity, strict=True):
                    grad, trust = p.grad.clone(), 1.0
                    if not self.excluded(name):
                        grad += self.weight_decay * p
                        w_norm, g_norm = torch.linalg.norm(p), torch.linalg.norm(grad)
                        if w_norm > 0 and g_norm > 0:
                            trust = self.eeta * w_norm / g_norm
                    if self.learning_rate_after_momentum:
                        v.mul_(self.momentum).add_(trust * grad)
                        p.sub_(lr * v)
                    else:
                        v.mul_(self.momentum).add_(lr * trust * grad)
                        p.sub_(v)
            after_update(step)
        return losses


def simclr_reference(run: dict[str, Any], optimizer: LarsReference,
                     batch_norm_groups: int = 1) -> dict[str, np.ndarray]:
    """TorchSimCLR on our views with NT-Xent at the run's temperature, trained by `optimizer`
    with simclr tf2/model.py `WarmUpAndCosineDecay` (linear warmup from 0, then cosine to 0 of
    the pre-increment step). `batch_norm_groups` > 1 (a negative control) normalises each of
    that many slices of the views separately, as BatchNorm per device would."""
    backbone = transformers.ResNetModel.from_pretrained(run["hf"])
    model = TorchSimCLR(backbone, run["initial"]).train()
    config = run["config"]
    o, temperature = config.optim, config.objective.temperature

    def loss_fn(step: int) -> Any:
        views = torch.tensor(run["views"][step])
        projections = torch.cat([model(part) for part in torch.chunk(views, batch_norm_groups)])
        return nt_xent_reference(projections, temperature)

    losses = optimizer.run(unique_parameters(model), loss_fn,
                           lambda step: cosine_learning_rate(step, o.learning_rate,
                                                             o.warmup_steps, config.train.steps),
                           len(run["batches"]))
    state = {("resnet." + k if k.startswith(("embedder", "encoder")) else k): v
             for k, v in torch_state(model).items()}
    state = {k.replace("backbone.", "resnet."): v for k, v in state.items()}
    return with_losses(losses, {k: v for k, v in state.items() if k in run["ours"]})


def test_simclr_trains_as_google_research_simclr(simclr_run):
    reference = simclr_reference(simclr_run, simclr_lars(simclr_run["config"]))
    assert difference_to("simclr", simclr_run["ours"], reference) <= TOLERANCE


def simclr_lars(config: Config, **changes: Any) -> LarsReference:
    o = config.optim
    return LarsReference(o.weight_decay, o.momentum, o.trust_coefficient, **{
        "learning_rate_after_momentum": o.learning_rate_after_momentum, **changes})


@pytest.mark.parametrize("control", ["lars_on_batch_norm", "batch_norm_per_device"])
def test_simclr_negative_controls(simclr_run, control):
    """Decay and trust ratio on BatchNorm parameters too; BatchNorm statistics per device
    (8 slices of 4 views) instead of over the global batch."""
    if control == "lars_on_batch_norm":
        reference = simclr_reference(simclr_run, simclr_lars(simclr_run["config"],
                                                             adapt_everything=True))
    else:
        reference = simclr_reference(simclr_run, simclr_lars(simclr_run["config"]),
                                     batch_norm_groups=8)
    assert difference_to(f"simclr {control}", simclr_run["ours"], reference) > CONTROL_MINIMUM


# ------------------------------------------------------------------------------------- ALBERT
# The masked-LM sizes with E = 16 < H = 32, the shared layer applied twice, LAMB as albert's
# optimization.py `create_optimizer` builds it (BERT's schedule, clip 1.0, weight decay 0.1
# instead of 0.01 for the same reason as BERT's).
ALBERT = [*MASKED_LM, "model.embedding_size=16", "optim.optimizer=lamb", "optim.schedule=linear"]


def albert_batches(config: Config) -> list[dict[str, np.ndarray]]:
    """`masked_lm_batches` with a random sentence-order label per row."""

    def sentence_order(batch: dict[str, np.ndarray], rng: np.random.Generator) -> None:
        batch["next_sentence_labels"] = rng.integers(0, 2, len(batch["input_ids"])).astype(
            np.int32)

    return masked_lm_batches(config, sentence_order)


@pytest.fixture(scope="module")
def albert_run(tmp_path_factory) -> dict[str, Any]:
    return family_run("albert_tiny", ALBERT, tmp_path_factory.mktemp("albert"), albert_batches)


def albert_reference(run: dict[str, Any], **changes: Any) -> dict[str, np.ndarray]:
    """AlbertForPreTraining on run_pretraining.py's MLM + mean SOP loss, trained by albert's
    LAMBOptimizer (`AdamWeightDecayReference` with `layer_adaptation`) with `changes`."""
    config = run["config"]
    return bert_reference(run, adam_weight_decay(config, layer_adaptation=True, **changes),
                          bert_schedule(config), "AlbertForPreTraining", "sop_logits")


def test_albert_trains_as_google_research_albert_lamb(albert_run):
    reference = albert_reference(albert_run)
    assert difference_to("albert", albert_run["ours"], reference) <= TOLERANCE


@pytest.mark.parametrize("control", ["adapt_layer_norm_and_bias", "bias_correction"])
def test_albert_negative_controls(albert_run, control):
    """The trust ratio on LayerNorm and biases too (optax.lamb's), Adam's bias correction
    (optax.lamb's, the LAMB paper's)."""
    changes = ({"adapt_everything": True} if control == "adapt_layer_norm_and_bias"
               else {"bias_correction": True})
    reference = albert_reference(albert_run, **changes)
    assert difference_to(f"albert {control}", albert_run["ours"], reference) > CONTROL_MINIMUM


# --------------------------------------------------------------------------------------- ELMo
# elmo_original's optimisation (Adagrad lr 0.2 with initial accumulator 1, the gradient of 20 x
# the mean loss, global-norm clip 10, sampled softmax) on a tiny biLM: 8-dim characters, three
# filters, 2 highway layers, 2 LSTMP layers of 32 cells -> 16 per direction, a vocabulary of
# 120 words and 32 sampled candidates, 20-token windows of 16 characters, no dropout. The
# windows are independent (each from a zero state) in `ELMO`, stateful streams in `ELMO_STREAMS`
# (the layout itself and resuming its carried states are checked in tests/test_elmo.py).
ELMO = ["model.char_embedding_dim=8", "model.char_filters=1:8,2:8,3:16", "model.lstm_dim=32",
        "model.projection_dim=16", "model.dropout=0.0", "model.vocab_size=120",
        "examples.max_characters_per_token=16", "examples.stateful_streams=0",
        "objective.negative_samples=32", "train.batch_size=8", "train.steps=10"]
# elmo_original's own layout: 8 stateful streams, one per batch row, each direction's LSTM
# states carried from batch to batch (the model holds them for 8 rows)
ELMO_STREAMS = [*ELMO[:-4], "examples.stateful_streams=8", "model.carried_state_rows=8",
                *ELMO[-3:]]


def param_state(model: nnx.Module, kind: Any = nnx.Param) -> dict[str, np.ndarray]:
    """`model`'s variables of `kind` by their paths ("bilm/lstm_kernel"), copied: the names
    of a torch re-statement that holds the same arrays, where no HF class exists."""
    return {"/".join(map(str, path)): np.array(variable.get_value(), copy=True)
            for path, variable in nnx.to_flat_state(nnx.state(model, kind))}


def torch_parameters(state: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """Leaf tensors (requires_grad) of `state`'s arrays, under the same names."""
    return {name: torch.tensor(value, requires_grad=True) for name, value in state.items()}


def elmo_windows(config: Config, count: int) -> list[dict[str, np.ndarray]]:
    """`count` windows of random sentences (over 200 random words, some outside the 120-word
    vocabulary) made by the method's own `windows`, in stream order; the stream's last, padded
    window is the last."""
    from pretext_jax.input_pipeline.examples import elmo as ee

    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghij"), rng.integers(1, 9))) for _ in range(200)]
    sentences = [" ".join(rng.choice(words, rng.integers(3, 15))) for _ in range(80)]
    vocabulary = ee.vocabulary_from_counts(ee.count_words(sentences), config.model.vocab_size)
    records = list(ee.windows(sentences, vocabulary, config.examples))
    assert len(records) > count and records[-1]["mask"].min() == 0
    return records[:count - 1] + records[-1:]


def elmo_batches(config: Config) -> list[dict[str, np.ndarray]]:
    """Independent windows, the padded one in the last row."""
    rows, size = config.train.batch_size * STEPS, config.train.batch_size
    records = elmo_windows(config, rows)
    return [{key: np.stack([r[key] for r in records[i:i + size]]) for key in records[0]}
            for i in range(0, rows, size)]


class _Windows(list):
    """A list of windows as `StreamWindows` reads a record directory (`.source`)."""

    @property
    def source(self) -> list[dict[str, np.ndarray]]:
        return self


def elmo_stream_batches(config: Config) -> list[dict[str, np.ndarray]]:
    """Stateful streams laid out by the method's `StreamWindows`: one row per stream of 5
    windows (the padded last window is the backward LM's first window of the last row), the
    backward LM's window as `backward_<field>`."""
    from pretext_jax.input_pipeline.examples.elmo import StreamWindows

    streams = config.examples.stateful_streams
    layout = StreamWindows(_Windows(elmo_windows(config, streams * 5)), streams)
    batches = []
    for step in range(STEPS):
        pairs = [layout[step * streams + row] for row in range(streams)]
        batches.append({
            **{key: np.stack([f[key] for f, _ in pairs]) for key in pairs[0][0]},
            **{f"backward_{key}": np.stack([b[key] for _, b in pairs]) for key in pairs[0][1]}})
    return batches


@pytest.fixture(scope="module")
def elmo_run(tmp_path_factory) -> dict[str, Any]:
    return elmo_family_run(ELMO, tmp_path_factory.mktemp("elmo"), elmo_batches)


@pytest.fixture(scope="module")
def elmo_stream_run(tmp_path_factory) -> dict[str, Any]:
    return elmo_family_run(ELMO_STREAMS, tmp_path_factory.mktemp("elmo_streams"),
                           elmo_stream_batches)


def elmo_family_run(overrides: list[str], workdir: Path,
                    make_batches: Callable[[Config], list[dict[str, np.ndarray]]]
                    ) -> dict[str, Any]:
    run = family_run("elmo_original", overrides, workdir, make_batches, export=param_state,
                     exported_part=None)
    run["candidates"] = [elmo_candidates(run["trainer"], step) for step in range(STEPS)]
    return run


def elmo_candidates(trainer: Trainer, step: int) -> list[np.ndarray]:
    """The sampled-softmax candidates our step `step` draws for the forward and backward LM,
    recomputed on the host from the step key fold_in(key(seed), step) as `elmo_loss` splits it
    (model, forward, backward); their distribution is tested in tests/test_elmo.py."""
    from pretext_jax.objectives.elmo import sample_log_uniform

    key = jax.random.fold_in(jax.random.key(trainer.config.train.seed), step)
    objective, vocab = trainer.objective, trainer.model_config.vocab_size
    return [np.asarray(sample_log_uniform(k, objective.negative_samples, vocab))
            for k in jax.random.split(key, 3)[1:]]


def torch_char_cnn(p: Mapping[str, Any], config: Any, chars: np.ndarray) -> Any:
    """bilm-tf training.py `_build_word_char_embeddings`: character embeddings, a convolution
    per filter (with bias) max-pooled over the characters, relu, the highway layers
    (carry = sigmoid(x Wc + bc), y = carry relu(x Wt + bt) + (1 - carry) x), projection."""
    prefix = "bilm/token_encoder/"
    x = p[prefix + "char_embedding"][long(chars)]  # [B, T, C, d]
    batch, length, width, depth = x.shape
    x = x.reshape(batch * length, width, depth).transpose(1, 2)
    features = []
    for i in range(len(config.filters)):
        kernel = p[f"{prefix}conv_kernels/{i}"].permute(2, 1, 0)  # [filters, d, width]
        conv = torch.nn.functional.conv1d(x, kernel, p[f"{prefix}conv_biases/{i}"])
        features.append(torch.relu(torch.max(conv, -1).values))
    h = torch.cat(features, -1)
    for layer in range(config.highway_layers):
        carry = torch.sigmoid(h @ p[prefix + "highway_carry"][layer]
                              + p[prefix + "highway_carry_bias"][layer])
        transform = torch.relu(h @ p[prefix + "highway_transform"][layer]
                               + p[prefix + "highway_transform_bias"][layer])
        h = carry * transform + (1.0 - carry) * h
    h = h @ p[prefix + "projection"] + p[prefix + "projection_bias"]
    return h.reshape(batch, length, -1)


def torch_lstm_stack(p: Mapping[str, Any], config: Any, direction: int, x: Any,
                     mask: Any, states: list[tuple[Any, Any]] | None = None) -> Any:
    """One direction's LSTM layers, tf.nn.rnn_cell.LSTMCell(num_proj, cell_clip, proj_clip)
    with forget bias 1: gates i, j, f, o of [x, h] W + b, c = sigmoid(f + 1) c +
    sigmoid(i) tanh(j) clipped, h = (sigmoid(o) tanh(c)) P clipped; from the second layer on
    the input is added (use_skip_connections). At padding the state is kept (bilm-tf's
    training stream has none: pretext's windows end in padding). From a zero state, or with
    `states` (one (h, c) per layer) from those, which are then replaced by the final states,
    detached (bilm-tf training.py `train`: the final states fed as the next batch's initial
    ones, numbers without gradient)."""
    for layer in range(config.num_layers):
        kernel, bias, projection = (p[f"bilm/lstm_{name}"][direction, layer]
                                    for name in ("kernel", "bias", "projection"))
        if states is None:
            h = torch.zeros(x.shape[0], projection.shape[1])
            c = torch.zeros(x.shape[0], projection.shape[0])
        else:
            h, c = states[layer]
        outputs = []
        for t in range(x.shape[1]):
            i, j, f, o = torch.chunk(torch.cat([x[:, t], h], -1) @ kernel + bias, 4, -1)
            new_c = torch.clamp(torch.sigmoid(f + 1.0) * c + torch.sigmoid(i) * torch.tanh(j),
                                -config.cell_clip, config.cell_clip)
            new_h = torch.clamp((torch.sigmoid(o) * torch.tanh(new_c)) @ projection,
                                -config.proj_clip, config.proj_clip)
            keep = mask[:, t:t + 1] > 0
            h, c = torch.where(keep, new_h, h), torch.where(keep, new_c, c)
            outputs.append(h)
        if states is not None:
            states[layer] = (h.detach(), c.detach())
        out = torch.stack(outputs, 1)
        x = out + x if config.residual and layer else out
    return x


def tf_sampled_softmax_nll(hidden: Any, targets: Any, kernel: Any, bias: Any,
                           candidates: np.ndarray) -> Any:
    """tf.nn.sampled_softmax_loss (`_compute_sampled_logits`, remove_accidental_hits,
    subtract_log_q) with the given candidates: true and sampled logits less the log of their
    expected counts, a candidate equal to the row's target pushed to -FLOAT_MAX, softmax
    cross-entropy with the true class first. The expected count is S P(k) for candidates drawn
    with replacement (pretext's documented departure from TF's unique sampler)."""
    vocab, count = kernel.shape[0], len(candidates)
    ids = torch.arange(vocab, dtype=torch.float32)
    log_q = torch.log(count * (torch.log(ids + 2) - torch.log(ids + 1)) / math.log(vocab + 1))
    sampled_ids = long(candidates)
    true_logits = torch.sum(hidden * kernel[targets], -1) + bias[targets] - log_q[targets]
    sampled = hidden @ kernel[sampled_ids].T + bias[sampled_ids]
    hits = sampled_ids[None] == targets[:, None]
    sampled = sampled + torch.where(hits, torch.finfo(torch.float32).min, 0.0)
    sampled = sampled - log_q[sampled_ids]
    logits = torch.cat([true_logits[:, None], sampled], 1)
    return -torch.log_softmax(logits, -1)[:, 0]


@dataclasses.dataclass(frozen=True)
class AdagradReference:
    """bilm-tf training.py `train`: tf.train.AdagradOptimizer(lr, initial_accumulator_value=1.0)
    on the gradient of loss * unroll_steps (`loss_scale`), clipped to global norm
    all_clip_norm_val (10): a += g^2, w -= lr g / sqrt(a). Negative controls: no loss scale,
    TF's default accumulator 0.1."""

    loss_scale: float
    clip_norm: float
    initial_accumulator: float = 1.0

    def run(self, named: list[tuple[str, Any]], loss_fn: Callable[[int], Any],
            learning_rate: Callable[[int], float], steps: int) -> list[float]:
        accumulators = [torch.full_like(p, self.initial_accumulator) for _, p in named]
        losses = []
        for step in range(steps):
            scaled = loss_and_gradients(named, lambda s: loss_fn(s) * self.loss_scale, step)
            losses.append(scaled / self.loss_scale)
            grads = [p.grad.detach().clone() for _, p in named]
            if self.clip_norm:
                tf_clip_by_global_norm(grads, self.clip_norm)
            with torch.no_grad():
                for (_, p), g, a in zip(named, grads, accumulators, strict=True):
                    a.add_(g * g)
                    p.sub_(learning_rate(step) * g / torch.sqrt(a))
        return losses


def elmo_reference(run: dict[str, Any], carry: bool = False, **changes: Any
                   ) -> dict[str, np.ndarray]:
    """The biLM re-stated in torch from bilm-tf training.py `LanguageModel` on our initial
    parameters, with its `_build_loss`: per direction the mean sampled-softmax loss over the
    real targets (the candidates our step drew), total 0.5 (forward + backward), trained by
    `AdagradReference` with elmo_original's settings and `changes`. Batches of stateful
    streams hold the backward LM's own window (`backward_*`); with `carry` each direction's
    LSTM starts where its previous batch left it (else from zero)."""
    config, batches = run["config"], run["batches"]
    model = run["initial"].config
    p = torch_parameters(param_state(run["initial"]))
    states: list[list[tuple[Any, Any]] | None] = [None, None]
    if carry:
        rows = config.train.batch_size
        states = [[(torch.zeros(rows, model.projection_dim), torch.zeros(rows, model.lstm_dim))
                   for _ in range(model.num_layers)] for _ in range(2)]

    def loss_fn(step: int) -> Any:
        b = batches[step]
        ids, mask = long(b["ids"]), torch.tensor(b["mask"], dtype=torch.float32)
        backward_ids = long(b.get("backward_ids", b["ids"]))
        backward_mask = torch.tensor(b.get("backward_mask", b["mask"]), dtype=torch.float32)
        real, backward_real = mask[:, 1:-1], backward_mask[:, 1:-1]
        forward = torch_lstm_stack(p, model, 0, torch_char_cnn(p, model, b["chars"]), real,
                                   states[0])
        backward_tokens = torch_char_cnn(p, model, b.get("backward_chars", b["chars"]))
        backward = torch.flip(torch_lstm_stack(p, model, 1, torch.flip(backward_tokens, [1]),
                                               torch.flip(backward_real, [1]), states[1]), [1])
        loss = 0.0
        for hidden, targets, present, inputs, candidates in (
                (forward, ids[:, 2:], mask[:, 2:], real, run["candidates"][step][0]),
                (backward, backward_ids[:, :-2], backward_mask[:, :-2], backward_real,
                 run["candidates"][step][1])):
            nll = tf_sampled_softmax_nll(hidden.reshape(-1, hidden.shape[-1]),
                                         targets.reshape(-1), p["softmax_kernel"],
                                         p["softmax_bias"], candidates)
            weights = (inputs * present).reshape(-1)
            loss = loss + 0.5 * torch.sum(weights * nll) / torch.sum(weights)
        return loss

    optimizer = AdagradReference(**{"loss_scale": config.objective.loss_scale,
                                    "clip_norm": config.optim.clip_norm, **changes})
    losses = optimizer.run(list(p.items()), loss_fn, lambda step: config.optim.learning_rate,
                           len(batches))
    return with_losses(losses, {name: value.detach().numpy() for name, value in p.items()})


def test_elmo_trains_as_bilm_tf_adagrad(elmo_run):
    reference = elmo_reference(elmo_run)
    assert difference_to("elmo", elmo_run["ours"], reference) <= TOLERANCE


@pytest.mark.parametrize("control", ["no_loss_scale", "tf_default_accumulator", "no_clipping"])
def test_elmo_negative_controls(elmo_run, control):
    """The gradient of the mean loss (no x unroll_steps), Adagrad's TF default initial
    accumulator 0.1, no gradient clipping."""
    changes = {"no_loss_scale": {"loss_scale": 1.0},
               "tf_default_accumulator": {"initial_accumulator": 0.1},
               "no_clipping": {"clip_norm": 0.0}}[control]
    reference = elmo_reference(elmo_run, **changes)
    assert difference_to(f"elmo {control}", elmo_run["ours"], reference) > CONTROL_MINIMUM


def test_elmo_stateful_streams_train_as_bilm_tf(elmo_stream_run):
    """Four steps of elmo_original's stateful streams: each direction continues from the LSTM
    states its previous batch left (the backward LM reading its own window right to left), as
    bilm-tf's `train` feeds them back. Control: every batch from a zero state."""
    reference = elmo_reference(elmo_stream_run, carry=True)
    assert difference_to("elmo streams", elmo_stream_run["ours"], reference) <= TOLERANCE
    zero_states = elmo_reference(elmo_stream_run)
    assert difference_to("elmo streams from zero", elmo_stream_run["ours"],
                         zero_states) > CONTROL_MINIMUM


# ------------------------------------------------------------------------------- MoCo, BYOL
# SimCLR's narrow ResNet-10 (ImageNet stem, for HF's ResNetModel) on the same 16 images. The
# momentum/EMA rates are lower than the papers' (MoCo 0.9, BYOL's base 0.9: 0.99 and 0.996 in
# them) so that four updates move the key/target encoders by more than the comparison's
# resolution; the formulas are the references'. MoCo's keys come out of the key encoder's
# forward with BatchNorm over 8 images (two groups of the shuffle), where float32 alone is off
# by up to 7e-6 in a normalised key (torch float32 against float64, ours closer): at moco_tiny's
# lr 0.0075 that noise in the logits (/ T = 0.2) grows past 1e-2 in the parameters within four
# steps, in either implementation, so lr 0.001 here. The queue holds those keys as computed and
# is compared within STATE_TOLERANCE, a few times torch's own float32 error.
MOCO = ["model.stem=imagenet", "model.depth=10", "model.base_width=4", "model.projection_dim=16",
        "model.queue_size=64", "objective.momentum=0.9", "objective.shuffle_bn_groups=2",
        "train.batch_size=16", "train.steps=10", "optim.learning_rate=0.001"]
BYOL = ["model.stem=imagenet", "model.depth=10", "model.base_width=4",
        "model.projection_hidden_dim=32", "model.projection_dim=16",
        "model.predictor_hidden_dim=32",
        "objective.base_target_decay=0.9", *LARS_STEPS]


def with_params(module: nnx.Module) -> nnx.Module:
    """A copy of `module` whose `EMA` variables (a momentum encoder's) are `nnx.Param`s again,
    as the HF conversion and `encoder_state` read them (models/momentum.py `momentum_copy`
    the other way)."""
    from pretext_jax.models.momentum import EMA

    graphdef, ema, rest = nnx.split(nnx.clone(module), EMA, ...)
    params = jax.tree.map(lambda v: nnx.Param(v.get_value(), **v.get_metadata()), ema,
                          is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, params, rest)


def mlp_state(mlp: nnx.Module, prefix: str) -> dict[str, np.ndarray]:
    """models/momentum.py `MLP`'s parameters under the names of `TorchMLP`'s."""
    state = {}
    for name in ("hidden", "output"):
        layer = getattr(mlp, name)
        state[f"{prefix}{name}.weight"] = np.array(layer.kernel[...]).T
        if layer.bias is not None:
            state[f"{prefix}{name}.bias"] = np.array(layer.bias[...])
    if mlp.normalization is not None:
        state[f"{prefix}normalization.weight"] = np.array(mlp.normalization.scale[...])
        state[f"{prefix}normalization.bias"] = np.array(mlp.normalization.bias[...])
    return state


def encoder_state(encoder: nnx.Module, prefix: str) -> dict[str, np.ndarray]:
    """A momentum `Encoder`'s (backbone + MLP head) under the names of `TorchEncoder`'s."""
    return {**resnet_state(encoder.backbone, prefix + "backbone."),
            **mlp_state(encoder.head, prefix + "head.")}


class TorchMLP(torch.nn.Module):
    """dense, [BatchNorm, training mode], ReLU, dense: MoCo builder.py's `--mlp` head
    (Linear, ReLU, fc; no BatchNorm), BYOL's projector and predictor (utils/networks.py `MLP`:
    Linear, BatchNorm, ReLU, Linear without bias), holding an `MLP`'s weights."""

    def __init__(self, mlp: nnx.Module):
        super().__init__()
        self.hidden = torch_linear(mlp.hidden)
        self.normalization = (None if mlp.normalization is None
                              else torch_batch_norm(mlp.normalization))
        self.output = torch_linear(mlp.output)

    def forward(self, x: Any) -> Any:
        x = self.hidden(x)
        if self.normalization is not None:
            x = self.normalization(x)
        return self.output(torch.relu(x))


class TorchEncoder(torch.nn.Module):
    """HF ResNetModel (pooled features) + `TorchMLP` head, in training mode."""

    def __init__(self, backbone_folder: Path, head: nnx.Module):
        super().__init__()
        self.backbone = transformers.ResNetModel.from_pretrained(backbone_folder)
        self.head = TorchMLP(head)
        self.train()

    def forward(self, images: Any) -> Any:
        return self.head(self.backbone(pixel_values=images.permute(0, 3, 1, 2))
                         .pooler_output.flatten(1))


def in_groups(module: Any, images: Any, groups: int) -> Any:
    """`module` on `groups` consecutive slices of `images`, BatchNorm per slice (one GPU's
    batch of the reference's DistributedDataParallel runs, no SyncBatchNorm)."""
    return torch.cat([module(part) for part in torch.chunk(images, groups)])


def moco_state(model: nnx.Module) -> dict[str, np.ndarray]:
    return {**encoder_state(model.online, "query."),
            **encoder_state(with_params(model.target), "key."),
            "queue": np.array(model.queue[...], copy=True),
            "queue_pointer": np.array(model.queue_pointer[...], copy=True)}


@pytest.fixture(scope="module")
def moco_run(tmp_path_factory) -> dict[str, Any]:
    run = family_run("moco_tiny", MOCO, tmp_path_factory.mktemp("moco"), image_batches,
                     export=moco_state, exported_part=lambda model: model.online.backbone)
    trainer, size = run["trainer"], run["config"].train.batch_size
    run["views"] = [augmented_views(trainer, step, batch["image"],
                                    lambda key: jax.random.split(key)[0])
                    for step, batch in enumerate(run["batches"])]
    run["shuffles"] = [np.asarray(jax.random.permutation(
        jax.random.split(step_key(trainer, step))[1], size)) for step in range(STEPS)]
    return run


def moco_reference(run: dict[str, Any], momentum_update: bool = True,
                   enqueue_first: bool = False) -> dict[str, np.ndarray]:
    """facebookresearch/moco builder.py `MoCo.forward` and main_moco.py `train`: the key
    encoder starts as a copy of the query encoder; each step first moves it, k <- m k +
    (1 - m) q, then computes q = normalize(f_q(view 1)), the keys of the shuffled view 2
    (the shuffle our step drew; BatchNorm per GPU: `shuffle_bn_groups` slices), normalised
    and unshuffled, logits [q.k, q.queue] / T against label 0 (CrossEntropyLoss), and
    enqueues the keys after the loss; torch.optim.SGD(momentum, weight_decay) on the query
    encoder with `adjust_learning_rate`'s cosine (one epoch per step here). Negative
    controls: no momentum update; the keys enqueued before the loss."""
    import copy

    config, initial = run["config"], run["initial"]
    objective, o = config.objective, config.optim
    query = TorchEncoder(run["hf"], initial.online.head)
    key = copy.deepcopy(query)
    for p in key.parameters():
        p.requires_grad = False
    queue = torch.tensor(np.array(initial.queue[...])).T.contiguous()  # builder's [dim, K]
    pointer = [0]
    groups = objective.shuffle_bn_groups

    def enqueue(keys: Any) -> None:
        queue[:, pointer[0]:pointer[0] + len(keys)] = keys.T
        pointer[0] = (pointer[0] + len(keys)) % queue.shape[1]

    def loss_fn(step: int) -> Any:
        first, second = torch.chunk(torch.tensor(run["views"][step]), 2)
        q = torch.nn.functional.normalize(in_groups(query, first, groups), dim=1)
        with torch.no_grad():
            if momentum_update:
                for p_k, p_q in zip(key.parameters(), query.parameters(), strict=True):
                    p_k.data = p_k.data * objective.momentum + p_q.data * (1.0 - objective.momentum)
            shuffle = torch.tensor(run["shuffles"][step])
            k = torch.nn.functional.normalize(in_groups(key, second[shuffle], groups), dim=1)
            k = k[torch.argsort(shuffle)]
        if enqueue_first:
            enqueue(k)
        logits = torch.cat([torch.sum(q * k, 1, keepdim=True), q @ queue.clone().detach()], 1)
        loss = torch.nn.functional.cross_entropy(logits / objective.temperature,
                                                 torch.zeros(len(q), dtype=torch.long))
        if not enqueue_first:
            enqueue(k)
        return loss

    optimizer = torch.optim.SGD(query.parameters(), lr=o.learning_rate, momentum=o.momentum,
                                weight_decay=o.weight_decay)
    named, losses = list(query.named_parameters()), []
    for step in range(len(run["batches"])):
        losses.append(loss_and_gradients(named, loss_fn, step))
        for group in optimizer.param_groups:
            group["lr"] = cosine_learning_rate(step, o.learning_rate, 0, config.train.steps)
        optimizer.step()
    state = {**torch_state(query, "query."), **torch_state(key, "key."),
             "queue": queue.T.numpy().copy(), "queue_pointer": np.int32(pointer[0])}
    return with_losses(losses, {k: v for k, v in state.items() if k in run["ours"]})


def test_moco_trains_as_facebookresearch_moco(moco_run):
    """Losses, query and key encoders within TOLERANCE, the queue (its keys) within
    STATE_TOLERANCE (see the notes above MOCO)."""
    difference, keys = state_parity(moco_run["ours"], moco_reference(moco_run),
                                    ("queue", "queue_pointer"))
    print(f"moco: {difference:.2e}, queue {keys:.2e}")
    assert difference <= TOLERANCE and keys <= STATE_TOLERANCE


@pytest.mark.parametrize("control", ["no_momentum_update", "keys_enqueued_before_the_loss"])
def test_moco_negative_controls(moco_run, control):
    changes = ({"momentum_update": False} if control == "no_momentum_update"
               else {"enqueue_first": True})
    reference = moco_reference(moco_run, **changes)
    assert difference_to(f"moco {control}", moco_run["ours"], reference) > CONTROL_MINIMUM


def byol_state(model: nnx.Module) -> dict[str, np.ndarray]:
    return {**encoder_state(model.online, "online."),
            **mlp_state(model.predictor, "predictor."),
            **encoder_state(with_params(model.target), "target.")}


@pytest.fixture(scope="module")
def byol_run(tmp_path_factory) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("byol")
    run = family_run("byol_tiny", BYOL, workdir, image_batches, export=byol_state,
                     exported_part=lambda model: model.online.backbone)
    run["hf_target"] = workdir / "hf_target"
    hf.save(with_params(run["initial"].target).backbone, run["hf_target"])
    run["views"] = [augmented_views(run["trainer"], step, batch["image"])
                    for step, batch in enumerate(run["batches"])]
    return run


def byol_reference(run: dict[str, Any], target_update: bool = True,
                   **lars: Any) -> dict[str, np.ndarray]:
    """deepmind byol byol_experiment.py `_update_fn`: online (ResNet, projector, predictor)
    and an independently initialised target (ResNet, projector; ours, converted), each view
    through each network on its own (BatchNorm per view), loss = mean over images of
    regression_loss(p_1, z'_2) + regression_loss(p_2, z'_1) (||a/|a| - b/|b|||^2), the
    optimizer's LARS (`LarsReference` with `learning_rate_after_momentum`, exclude_bias_and_norm)
    with warmup then cosine, then the target update target <- tau target + (1 - tau) online
    with schedules.py `target_ema` tau_t = 1 - (1 - base) (cos(pi t / K) + 1) / 2. Our state
    after step t holds the target the reference's step t used (objectives/byol.py), so the
    reference's update after the last step, which no step here uses, is left out. Negative
    controls: no target update; SimCLR's LARS (the rate inside the momentum)."""
    config, initial = run["config"], run["initial"]
    objective, o = run["trainer"].objective, config.optim  # target_decay_steps resolved
    online = TorchEncoder(run["hf"], initial.online.head)
    predictor = TorchMLP(initial.predictor).train()
    target = TorchEncoder(run["hf_target"], with_params(initial.target).head)
    for p in target.parameters():
        p.requires_grad = False

    def regression(x: Any, y: Any) -> Any:
        difference = (torch.nn.functional.normalize(x, dim=-1, eps=1e-6)
                      - torch.nn.functional.normalize(y, dim=-1, eps=1e-6))
        return torch.sum(difference * difference, -1)

    def loss_fn(step: int) -> Any:
        first, second = torch.chunk(torch.tensor(run["views"][step]), 2)
        with torch.no_grad():
            target_first, target_second = target(first), target(second)
        return torch.mean(regression(predictor(online(first)), target_second)
                          + regression(predictor(online(second)), target_first))

    def update_target(step: int) -> None:
        total = objective.target_decay_steps
        tau = 1.0 - (1.0 - objective.base_target_decay) * (math.cos(math.pi * step / total)
                                                           + 1.0) / 2.0
        if target_update and step < len(run["batches"]) - 1:
            with torch.no_grad():
                for p_t, p_o in zip(target.parameters(), online.parameters(), strict=True):
                    p_t.mul_(tau).add_((1.0 - tau) * p_o)

    losses = simclr_lars(config, **lars).run(
        unique_parameters(online, predictor), loss_fn,
        lambda step: cosine_learning_rate(step, o.learning_rate, o.warmup_steps,
                                          config.train.steps),
        len(run["batches"]), update_target)
    state = {**torch_state(online, "online."), **torch_state(predictor, "predictor."),
             **torch_state(target, "target.")}
    return with_losses(losses, {k: v for k, v in state.items() if k in run["ours"]})


def test_byol_trains_as_deepmind_byol(byol_run):
    reference = byol_reference(byol_run)
    assert difference_to("byol", byol_run["ours"], reference) <= TOLERANCE


@pytest.mark.parametrize("control", ["no_target_update", "simclr_lars_momentum"])
def test_byol_negative_controls(byol_run, control):
    changes = ({"target_update": False} if control == "no_target_update"
               else {"learning_rate_after_momentum": False})
    reference = byol_reference(byol_run, **changes)
    assert difference_to(f"byol {control}", byol_run["ours"], reference) > CONTROL_MINIMUM


# -------------------------------------------------------------------------------------- XLNet
# The masked-LM sizes as XLNet: 24 tokens of which 8 are reused into a memory of 16 per layer,
# orders in blocks of 8, 6 targets, memory carried over the four steps. xlnet
# model_utils.py `get_train_op` as xlnet_base trains (weight_decay > 0: AdamWeightDecayOptimizer,
# decay on r_w/r_r/r_s biases too; warmup then poly decay from the peak to lr x min_lr_ratio
# 0.001; clip 1.0), weight decay 0.1 for the same reason as BERT's. The memory, hidden states
# after LayerNorm carried between steps, is a forward state (STATE_TOLERANCE; measured 9.5e-6).
XLNET = ["model.vocab_size=120", "model.hidden_size=32", "model.num_heads=2",
         "model.intermediate_size=64", "model.mem_len=16", "model.reuse_len=8",
         "model.memory_batch_size=8", "examples.max_seq_length=24", "examples.reuse_len=8",
         "examples.perm_size=8", "examples.num_predict=6", "examples.num_streams=8",
         *[o for o in MASKED_LM if o.startswith(("train.", "optim."))],
         "optim.schedule=linear_from_peak", "optim.end_learning_rate=3e-6"]
XLNET_DECAYED_BIASES = ("r_s_bias", "r_r_bias", "r_w_bias")


def xlnet_batches(config: Config) -> list[dict[str, np.ndarray]]:
    """bench/throughput.py's permutation-LM batches (XLNet's own `PermutationSampling`), seeds
    0, 1, ..."""
    return [synthetic_batch(config, seed) for seed in range(STEPS)]


def xlnet_state(model: nnx.Module) -> dict[str, np.ndarray]:
    """HF names (`hf_state`) and the recurrence memory [L, B, M, H]."""
    return {**hf_state(model), "memory": np.array(model.memory[...], copy=True)}


@pytest.fixture(scope="module")
def xlnet_run(tmp_path_factory) -> dict[str, Any]:
    from pretext_jax.objectives.xlnet import permutation_mask

    run = family_run("xlnet_tiny", XLNET, tmp_path_factory.mktemp("xlnet"), xlnet_batches,
                     export=xlnet_state)
    reuse = run["initial"].config.reuse_len
    run["perm_masks"] = [np.asarray(permutation_mask(b["perm_rank"], b["perm_target"],
                                                     b["perm_hidden"], reuse))
                         for b in run["batches"]]
    return run


def xlnet_learning_rate(step: int, peak: float, warmup: int, total: int, end: float) -> float:
    """xlnet model_utils.py `get_train_op` (decay_method poly): step / warmup * peak while
    step < warmup, else polynomial_decay(peak, step - warmup, total - warmup, end), power 1."""
    if step < warmup:
        return step / warmup * peak
    return (peak - end) * (1.0 - min(step - warmup, total - warmup) / (total - warmup)) + end


def xlnet_reference(run: dict[str, Any], optimizer: AdamWeightDecayReference,
                    learning_rate: Callable[[int], float]) -> dict[str, np.ndarray]:
    """XLNetLMHeadModel on function_builder.py `two_stream_loss`: the query stream's logits at
    `target_mapping` (one-hot rows, all-zero rows for padding targets as data_utils.py pads
    them: a one-hot padding row at position 0 would add its query to a real target's there),
    sum(w nll) / sum(w), with the perm_mask our step builds (from
    the batch's orders; tested against data_utils.py in tests/test_xlnet_examples.py) and the
    memory carried from step to step (zeros first, as train_gpu.py's initial `mems`; each step's
    new memory, the last mem_len of [memory; the first reuse_len states] per layer)."""
    model = tf_embeddings(transformers.XLNetLMHeadModel.from_pretrained(run["hf"]).eval())
    config, batches = run["initial"].config, run["batches"]
    size = batches[0]["input_ids"].shape[0]
    mems = [torch.zeros(config.mem_len, size, config.hidden_size)
            for _ in range(config.num_layers)]

    def loss_fn(step: int) -> Any:
        b = batches[step]
        weights = torch.tensor(b["target_weights"], dtype=torch.float32)
        mapping = torch.nn.functional.one_hot(long(b["target_positions"]),
                                              b["input_ids"].shape[1]) * weights[..., None]
        out = model(input_ids=long(b["input_ids"]), token_type_ids=long(b["segment_ids"]),
                    perm_mask=torch.tensor(run["perm_masks"][step]), target_mapping=mapping,
                    mems=mems, use_mems=True)
        mems[:] = out.mems
        return torch.sum(weights * log_softmax_nll(out.logits, long(b["target_ids"]))) \
            / torch.sum(weights)

    losses = optimizer.run(unique_parameters(model), loss_fn, learning_rate, len(batches))
    state = {**torch_state(model),
             "memory": torch.stack([m.transpose(0, 1) for m in mems]).numpy()}
    return with_losses(losses, {k: v for k, v in state.items() if k in run["ours"]})


def xlnet_schedule(config: Config) -> Callable[[int], float]:
    o = config.optim
    return lambda step: xlnet_learning_rate(step, o.learning_rate, o.warmup_steps,
                                            config.train.steps, o.end_learning_rate)


def test_xlnet_trains_as_zihangdai_xlnet(xlnet_run):
    config = xlnet_run["config"]
    reference = xlnet_reference(
        xlnet_run, adam_weight_decay(config, include_in_decay=XLNET_DECAYED_BIASES),
        xlnet_schedule(config))
    difference, memory = state_parity(xlnet_run["ours"], reference, ("memory",))
    print(f"xlnet: {difference:.2e}, memory {memory:.2e}")
    assert difference <= TOLERANCE and memory <= STATE_TOLERANCE


@pytest.mark.parametrize("control", ["relative_biases_not_decayed", "bert_schedule"])
def test_xlnet_negative_controls(xlnet_run, control):
    """The r_w/r_r/r_s biases excluded from decay as biases (BERT's rule, pretext's before);
    BERT's schedule (decay from step 0, to 0)."""
    config = xlnet_run["config"]
    optimizer = adam_weight_decay(config, include_in_decay=XLNET_DECAYED_BIASES)
    schedule = xlnet_schedule(config)
    if control == "relative_biases_not_decayed":
        optimizer = dataclasses.replace(optimizer, include_in_decay=())
    else:
        schedule = bert_schedule(config)
    reference = xlnet_reference(xlnet_run, optimizer, schedule)
    assert difference_to(f"xlnet {control}", xlnet_run["ours"], reference) > CONTROL_MINIMUM


# ---------------------------------------------------------------------------------- wav2vec 2.0
# The tiny model (3 convolutions to 32 channels, 2 layers of 64, 2 x 32 codevectors) on 4,000
# samples (49 frames) per utterance, no padding (fairseq crops a batch to its shortest
# utterance), 10 distractors; wav2vec2_tiny's fairseq Adam (decay on every parameter, eps
# before the bias correction, no clipping) with warmup 2 then the polynomial decay.
WAV2VEC2 = ["model.activation_dropout=0.0", "examples.max_samples=4000",
            "objective.num_negatives=10", "train.batch_size=8", "train.steps=10",
            "optim.warmup_steps=2"]


def wav2vec2_batches(config: Config) -> list[dict[str, np.ndarray]]:
    """Tones of random pitch and amplitude in noise, unpadded, with the masks and distractors
    of the method's own host-side sampler (`mask_batch`, the data pipeline's)."""
    from pretext_jax.objectives.wav2vec2 import mask_batch

    rng = np.random.default_rng(0)
    size, samples = config.train.batch_size, config.examples.max_samples
    time = np.arange(samples) / 16000.0
    batches = []
    for _ in range(STEPS):
        pitch = rng.uniform(100, 2000, (size, 1))
        audio = (rng.uniform(0.2, 1.0, (size, 1)) * np.sin(2 * np.pi * pitch * time)
                 + 0.1 * rng.normal(size=(size, samples))).astype(np.float32)
        attention_mask = np.ones((size, samples), np.int32)
        batches.append({"audio": audio, "attention_mask": attention_mask,
                        **mask_batch(config.model, attention_mask, config.objective, rng)})
    return batches


@pytest.fixture(scope="module")
def wav2vec2_run(tmp_path_factory) -> dict[str, Any]:
    from pretext_jax.objectives.wav2vec2 import gumbel_temperature

    run = family_run("wav2vec2_tiny", WAV2VEC2, tmp_path_factory.mktemp("wav2vec2"),
                     wav2vec2_batches)
    trainer, config = run["trainer"], run["initial"].config
    frames = run["batches"][0]["mask_time_indices"].shape
    shape = (*frames, config.num_codevector_groups, config.codevectors_per_group)
    # The Gumbel noise of our step: `Wav2Vec2.__call__` splits the step key in four, the third
    # for the quantizer's jax.random.gumbel.
    run["gumbel"] = [np.asarray(jax.random.gumbel(jax.random.split(step_key(trainer, step), 4)[2],
                                                  shape)) for step in range(STEPS)]
    run["temperatures"] = [float(gumbel_temperature(step, trainer.objective))
                           for step in range(STEPS)]
    return run


class GradMultiply(torch.autograd.Function):
    """fairseq modules/grad_multiply.py: the identity forward, the gradient times `scale`."""

    @staticmethod
    def forward(ctx: Any, x: Any, scale: float) -> Any:
        ctx.scale = scale
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None]:
        return grad * ctx.scale, None


def wav2vec2_reference(run: dict[str, Any], feature_grad_mult: float | None = None,
                       feature_penalty: bool = True) -> dict[str, np.ndarray]:
    """Wav2Vec2ForPreTraining in training mode (dropout and LayerDrop 0) with fairseq
    wav2vec2.py's pieces HF leaves out: the feature encoder's output through GradMultiply
    (`feature_grad_mult`) and its mean square (`features_pen`); the quantizer's Gumbel-softmax
    on our step's noise at fairseq's annealed temperature, straight-through with a forward of
    exactly the one-hot codes (models/wav2vec2.py's note; torch's hard - soft + soft is not
    exact, and the distractor check compares codes exactly). The loss: wav2vec_criterion.py
    with our masks and distractors, cross-entropy over [positive, distractors] of cosine / 0.1
    (distractors equal to the positive at -inf) summed over the masked frames, + 0.1 x the
    diversity loss x sample_size + 10 x features_pen x sample_size, divided by sample_size
    (fairseq's trainer scales the gradients by 1 / sample_size); fairseq's Adam and polynomial
    schedule. Negative controls: no gradient scaling of the feature encoder; no feature
    penalty."""
    from unittest import mock

    config, objective = run["config"], run["trainer"].objective
    model = transformers.Wav2Vec2ForPreTraining.from_pretrained(run["hf"]).train()
    scale = objective.feature_grad_mult if feature_grad_mult is None else feature_grad_mult
    captured: dict[str, Any] = {}

    def scaled_features(module: Any, inputs: Any, output: Any) -> Any:
        captured["features"] = GradMultiply.apply(output, scale)
        return captured["features"]

    model.wav2vec2.feature_extractor.register_forward_hook(scaled_features)
    batches, groups = run["batches"], run["initial"].config.num_codevector_groups
    codevectors = groups * run["initial"].config.codevectors_per_group

    def loss_fn(step: int) -> Any:
        b = batches[step]
        noise = torch.tensor(run["gumbel"][step]).reshape(-1, run["gumbel"][step].shape[-1])

        def gumbel_softmax(logits: Any, tau: float, hard: bool) -> Any:
            assert hard
            soft = torch.softmax((logits + noise) / tau, -1)
            index = torch.argmax(soft, -1, keepdim=True)
            return torch.zeros_like(soft).scatter_(-1, index, 1.0) + (soft - soft.detach())

        model.set_gumbel_temperature(run["temperatures"][step])
        mask = torch.tensor(b["mask_time_indices"]).to(torch.bool)
        with mock.patch.object(torch.nn.functional, "gumbel_softmax", gumbel_softmax):
            out = model(torch.tensor(b["audio"]), mask_time_indices=mask)
        positives = out.projected_quantized_states  # [B, T, P]
        index = long(b["sampled_negative_indices"])  # [B, T, K] frames of the same utterance
        negatives = positives[torch.arange(len(index))[:, None, None], index]  # [B, T, K, P]
        targets = torch.cat([positives[:, :, None], negatives], 2)
        logits = torch.cosine_similarity(out.projected_states[:, :, None].float(),
                                         targets.float(), dim=-1)
        logits = logits / objective.contrastive_temperature
        same = (negatives == positives[:, :, None]).all(-1)
        logits = torch.cat([logits[..., :1], logits[..., 1:].masked_fill(same, float("-inf"))],
                           -1)
        nll = -torch.log_softmax(logits, -1)[..., 0]
        sample_size = mask.sum()
        loss = torch.sum(nll[mask])
        loss = loss + objective.diversity_weight * sample_size * (
            codevectors - out.codevector_perplexity) / codevectors
        if feature_penalty:
            penalty = captured["features"].float().pow(2).mean()
            loss = loss + objective.feature_penalty_weight * sample_size * penalty
        return loss / sample_size

    o = config.optim
    losses = fairseq_adam(config).run(
        unique_parameters(model), loss_fn,
        lambda step: fairseq_learning_rate(step, o.learning_rate, o.warmup_steps,
                                           config.train.steps),
        len(batches))
    return with_losses(losses, {k: v for k, v in torch_state(model).items() if k in run["ours"]})


def test_wav2vec2_trains_as_fairseq_wav2vec2(wav2vec2_run):
    reference = wav2vec2_reference(wav2vec2_run)
    assert difference_to("wav2vec2", wav2vec2_run["ours"], reference) <= TOLERANCE


@pytest.mark.parametrize("control", ["no_feature_grad_mult", "no_feature_penalty"])
def test_wav2vec2_negative_controls(wav2vec2_run, control):
    changes = ({"feature_grad_mult": 1.0} if control == "no_feature_grad_mult"
               else {"feature_penalty": False})
    reference = wav2vec2_reference(wav2vec2_run, **changes)
    assert difference_to(f"wav2vec2 {control}", wav2vec2_run["ours"], reference) > CONTROL_MINIMUM
