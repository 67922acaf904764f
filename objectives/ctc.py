"""Speech recognition by CTC fine-tuning of wav2vec 2.0 (Baevski et al. 2020 §4; Graves et al.
2006), method `ctc` (`run.py finetune --task ctc` from a wav2vec 2.0): a linear output layer
over a character vocabulary on the pre-trained network (`models.wav2vec2.Wav2Vec2ForCTC`), time
and channel masks, the context network frozen for the first updates; fairseq's recipes per
labelled-data size as presets (`PRESETS`, `ctc_base_10m` .. `ctc_base_960h`; `base_10h` unless
`run.py finetune --recipe` names another). The loss, decoding, data and WER are
`objectives.common.ctc`'s.

From HuBERT (Hsu et al. 2021 §IV-C), method `ctc_hubert` (`run.py finetune --task ctc --init <a
pretext hubert run, or a HF HubertModel / HubertForCTC folder>`): the same network, loss, masks
and frozen updates on HuBERT's body (`models.hubert.HubertForCTC`), with fairseq's
examples/hubert/config/finetune/base_10h.yaml as its recipe (`HUBERT_PRESETS`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.models.hubert import Hubert, HubertCTCConfig, HubertForCTC
from pretext_jax.models.wav2vec2 import (
    SpeechEncoderConfig,
    Wav2Vec2Body,
    Wav2Vec2Config,
    Wav2Vec2CTCConfig,
    Wav2Vec2ForCTC,
    feature_lengths,
    with_body_of,
)
from pretext_jax.objectives.common.ctc import (
    CTC,
    CTC_REDUCTIONS,
    CTCExampleConfig,
    ctc_loss,
    prepare_ctc,
    wer_monitor,
)
from pretext_jax.objectives.common.speech import MaskingSettings, span_mask
from pretext_jax.objectives.registry import (
    Batch,
    DownstreamTask,
    Evaluation,
    FinetuneRecipe,
    Loader,
    Method,
    Metrics,
    PreparedData,
    Resolution,
    Start,
    register,
)

# --- The registered method: `run.py finetune --task ctc` ------------------------------------

@dataclasses.dataclass(frozen=True)
class CTCModelConfig(Wav2Vec2CTCConfig):
    """The fine-tuned network (`Wav2Vec2CTCConfig`) and where it starts: `init`, a pretext
    wav2vec 2.0 workdir or model directory or a HF Wav2Vec2 folder ("" = random)."""

    init: str = ""
    """The pre-trained (or fine-tuned) wav2vec 2.0 whose body the run starts from."""
    vocab_size: int = 0
    """Output classes; 0 = the vocabulary's size, set from the data."""

    def __post_init__(self) -> None:
        if self.vocab_size:
            super().__post_init__()
        else:  # the data sets it before the model is built
            Wav2Vec2Config.__post_init__(self)


@dataclasses.dataclass(frozen=True)
class CTCObjectiveConfig:
    """Fine-tuning settings (fairseq examples/wav2vec/config/finetuning/base_10h.yaml): time
    masks of `mask_span` frames from a `mask_start_fraction` of the frames (mask_prob 0.65 /
    10), channel masks of `channel_mask_span` channels from a `channel_mask_fraction` of them
    (mask_channel_prob 0.5 / 64), the context network frozen for `freeze_updates`, the loss
    reduced as `reduction` (`CTC_REDUCTIONS`; fairseq's `sentence_avg` is `sentences`)."""

    mask_start_fraction: float = 0.065
    """Fraction of frames that start a masked span (fairseq `mask_prob` / `mask_length`); 0 =
    no time masks."""
    mask_span: int = 10
    """Frames per time mask (fairseq `mask_length`)."""
    channel_mask_fraction: float = 0.0078125
    """Fraction of the channels that start a masked channel span (`mask_channel_prob` /
    `mask_channel_length`); 0 = none."""
    channel_mask_span: int = 64
    """Channels per channel mask (fairseq `mask_channel_length`)."""
    freeze_updates: int = 10000
    """Updates during which only the output layer trains (fairseq `freeze_finetune_updates`)."""
    reduction: str = "sentences"
    """mean, sentences, tokens or sum (see `objectives.ctc.CTC_REDUCTIONS`)."""

    def __post_init__(self) -> None:
        for name in ("mask_start_fraction", "channel_mask_fraction"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1)")
        if min(self.mask_span, self.channel_mask_span) < 1 or self.freeze_updates < 0:
            raise ValueError("mask_span and channel_mask_span must be >= 1, freeze_updates >= 0")
        if self.reduction not in CTC_REDUCTIONS:
            raise ValueError(f"reduction={self.reduction!r} must be one of {CTC_REDUCTIONS}")


def _spans(lengths: np.ndarray, width: int, fraction: float, span: int, min_spans: int,
           rng: np.random.Generator) -> np.ndarray:
    if fraction == 0.0:
        return np.zeros((len(lengths), width), bool)
    return span_mask(lengths, width, MaskingSettings(fraction, span, min_spans), rng)


class FinetuneMasking(grain.transforms.RandomMap):
    """An utterance -> the same plus `mask_time_indices` [T] over its real frames (fairseq's
    `compute_mask_indices`, at least 2 spans) and `mask_channel_indices` [H] (no minimum), drawn
    with Grain's per-record rng as `wav2vec2`'s pre-training masks are."""

    def __init__(self, config: Wav2Vec2CTCConfig, objective: CTCObjectiveConfig):
        self.config, self.objective = config, objective

    def random_map(self, element: dict[str, np.ndarray], rng: np.random.Generator
                   ) -> dict[str, np.ndarray]:
        o, c = self.objective, self.config
        frames = int(feature_lengths(c, len(element["attention_mask"])))
        real = np.maximum(feature_lengths(c, element["attention_mask"].sum(keepdims=True)), 0)
        return {**element,
                "mask_time_indices": _spans(real, frames, o.mask_start_fraction, o.mask_span, 2,
                                            rng)[0],
                "mask_channel_indices": _spans(np.array([c.hidden_size]), c.hidden_size,
                                               o.channel_mask_fraction, o.channel_mask_span, 0,
                                               rng)[0]}


def finetune_loss(model: Wav2Vec2ForCTC, batch: Batch, rng: jax.Array | None, *,
                  objective: CTCObjectiveConfig) -> tuple[jax.Array, Metrics]:
    """The CTC loss of a transcribed batch (`audio`, `attention_mask`, `labels` padded with -1;
    while training, `FinetuneMasking`'s masks); the context network's gradient is stopped while
    `model.updates` < `freeze_updates`, which training advances by one."""
    updates = model.updates.get_value()
    training = rng is not None
    logits, frames = model(batch["audio"], batch["attention_mask"],
                           batch.get("mask_time_indices") if training else None,
                           batch.get("mask_channel_indices") if training else None, rng,
                           frozen_context=updates < objective.freeze_updates)
    loss, per_utterance = ctc_loss(logits, frames, batch["labels"],
                                   blank_id=model.config.blank_id, reduction=objective.reduction)
    if training:
        model.updates.set_value(updates + 1)
    rows = jnp.ones((), jnp.float32) * per_utterance.shape[0]
    return loss, {"loss": (loss * rows, rows),
                  "frozen": (jnp.asarray(updates < objective.freeze_updates, jnp.float32),
                             jnp.ones((), jnp.float32))}


def build_ctc(config: CTCModelConfig, seed: int) -> Wav2Vec2ForCTC:
    """`Wav2Vec2ForCTC`, or `HubertForCTC` for a HuBERT body's config (`ctc_hubert`'s)."""
    model_class = HubertForCTC if isinstance(config, HubertCTCConfig) else Wav2Vec2ForCTC
    with nnx.use_eager_sharding(False):
        return model_class(config, rngs=nnx.Rngs(seed))


def pretrained_ctc(config: CTCModelConfig, seed: int,
                   load: Callable[[str], nnx.Module]) -> Wav2Vec2ForCTC | None:
    """A fresh output layer on the body of `config.init` (None: random init)."""
    if not config.init:
        return None
    pretrained = load(config.init)
    if not isinstance(pretrained, Wav2Vec2Body):
        raise UserError(f"model.init={config.init} holds a {type(pretrained).__name__}; CTC "
                        "fine-tuning starts from wav2vec 2.0 or HuBERT (a pretext wav2vec2 or "
                        "hubert run, or a HF Wav2Vec2 or Hubert folder)")
    try:
        return with_body_of(pretrained, build_ctc(config, seed))
    except ValueError as e:
        raise UserError(f"model.init={config.init}: {e}; leave the model sizes to run.py "
                        "finetune, which copies them from the starting point") from None


MASK_LENGTH, CHANNEL_MASK_LENGTH = 10, 64  # fairseq mask_length (default), mask_channel_length
ROWS = 96
"""Padded rows of `examples.max_samples` (250,000) per update: the most, in a multiple of 8,
within fairseq's 25,600,000 samples per update (`max_tokens` 3,200,000 x 2 GPUs x update_freq 4;
base_960h: x 8 GPUs)."""


def fairseq_recipe(updates: int, learning_rate: float, mask_prob: float, channel_prob: float,
                   layerdrop: float, freeze_updates: int, *, warmup: int | None = None,
                   hold: int | None = None, end_scale: float = 0.05, rows: int = ROWS
                   ) -> dict[str, dict[str, Any]]:
    """One of fairseq's examples/wav2vec/config/finetuning/base_*.yaml (Baevski et al. 2020
    §4.4, appendix B) on what they share: Adam (0.9, 0.98), eps 1e-8, no weight decay, the
    tri-stage schedule with phase ratios [0.1, 0.4, 0.5] from 0.01 x lr to 0.05 x lr, time
    masks of 10 frames, channel masks of 64 channels, activation dropout 0.1, the other
    dropouts 0, the loss averaged over utterances (`sentence_avg`). `mask_prob` and
    `channel_prob` are fairseq's (per span length). HuBERT's recipe (`ctc_hubert`) gives its
    stages in updates (`warmup`, `hold`), the rate where the run stops (`end_scale` x lr) and
    its `rows` per update."""
    warmup = updates // 10 if warmup is None else warmup
    hold = updates * 4 // 10 if hold is None else hold
    return {
        "model": {"hidden_dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.1,
                  "feature_projection_dropout": 0.0, "final_dropout": 0.0,
                  "layerdrop": layerdrop},
        "objective": {"mask_start_fraction": mask_prob / MASK_LENGTH, "mask_span": MASK_LENGTH,
                      "channel_mask_fraction": channel_prob / CHANNEL_MASK_LENGTH,
                      "channel_mask_span": CHANNEL_MASK_LENGTH,
                      "freeze_updates": freeze_updates, "reduction": "sentences"},
        "optim": {"optimizer": "adamw", "learning_rate": learning_rate, "schedule": "tri_stage",
                  "warmup_steps": warmup, "hold_steps": hold,
                  "warmup_init_learning_rate": learning_rate / 100,
                  "end_learning_rate": learning_rate * end_scale, "b1": 0.9, "b2": 0.98,
                  "eps": 1e-8, "weight_decay": 0.0, "bias_correction": True,
                  "eps_before_bias_correction": True, "clip_norm": 0.0},
        "train": {"steps": updates, "batch_size": rows},
    }


PRESETS = {  # fairseq examples/wav2vec/config/finetuning/<name without ctc_>.yaml
    "ctc_base_10m": fairseq_recipe(13000, 5e-5, 0.65, 0.25, 0.1, 10000),
    "ctc_base_1h": fairseq_recipe(13000, 5e-5, 0.65, 0.25, 0.1, 10000),
    "ctc_base_10h": fairseq_recipe(20000, 5e-5, 0.65, 0.5, 0.05, 10000),
    "ctc_base_100h": fairseq_recipe(80000, 3e-5, 0.65, 0.5, 0.1, 0),
    "ctc_base_960h": fairseq_recipe(320000, 1e-4, 0.5, 0.1, 0.1, 0),
}
RECIPE_PRESET = "ctc_base_10h"  # what `run.py finetune --task ctc` runs without --recipe
NETWORK_FIELDS = tuple(f.name for f in dataclasses.fields(Wav2Vec2Config)
                       if f.name not in PRESETS[RECIPE_PRESET]["model"]
                       and f.name != "quantizer_input_dropout")


def body_recipe(pretrained: Wav2Vec2Body, method: str, presets: Mapping[str, Any],
                default: str, network_fields: tuple[str, ...]) -> FinetuneRecipe:
    """The fine-tuning run of `method` from `pretrained`: its `network_fields` and the
    `default` one of `presets`, which `--recipe` chooses among."""
    network = {f"model.{name}": getattr(pretrained.config, name) for name in network_fields}
    preset = presets[default]
    recipe = {f"{section}.{key}": value for section, values in preset.items()
              for key, value in values.items()}
    return FinetuneRecipe(values={"method": method, **{k: list(v) if isinstance(v, tuple) else v
                                                        for k, v in network.items()}, **recipe},
                          epochs=0, warmup=0.0, steps=preset["train"]["steps"],
                          warmup_steps=preset["optim"]["warmup_steps"], recipes=tuple(presets))


def ctc_recipe(pretrained: Any, task: DownstreamTask, source_config: Mapping[str, Any]
               ) -> FinetuneRecipe | None:
    """wav2vec 2.0 (pre-trained or fine-tuned) on task `ctc`: the starting network's sizes
    and the `RECIPE_PRESET` recipe (base_10h: 20,000 updates, 2,000 warmup, 8,000 hold, 10,000
    decay, the context network frozen for the first 10,000); `--recipe` chooses another of
    `PRESETS`. HuBERT's bodies are `ctc_hubert`'s."""
    if (task.name != CTC or not isinstance(pretrained, Wav2Vec2Body)
            or not isinstance(pretrained.config, Wav2Vec2Config)
            or isinstance(pretrained.config, HubertCTCConfig)):
        return None
    return body_recipe(pretrained, CTC, PRESETS, RECIPE_PRESET, NETWORK_FIELDS)


def ctc_transforms(data: PreparedData, model: CTCModelConfig, objective: CTCObjectiveConfig,
                   load: Loader | None = None) -> PreparedData:
    del load
    return dataclasses.replace(data, transforms=(FinetuneMasking(model, objective),))


METHOD = register(Method(
    name=CTC,
    model_config=CTCModelConfig,
    example_config=CTCExampleConfig,
    objective_config=CTCObjectiveConfig,
    build_model=build_ctc,
    loss=finetune_loss,
    prepare=prepare_ctc,
    units_per_example=lambda examples: examples.max_samples,
    unit="samples",
    description="Fine-tuning: speech recognition with CTC on wav2vec 2.0 (WER, CER)",
    resolution=Resolution(complete_data=ctc_transforms),
    evaluation=Evaluation(monitor=wer_monitor),
    presets=PRESETS,
    start=Start(hf_models=(Wav2Vec2ForCTC,), pretrained=pretrained_ctc, finetunes=ctc_recipe),
))


# --- From HuBERT: method `ctc_hubert` ---------------------------------------------------------

HUBERT_CTC = "ctc_hubert"


@dataclasses.dataclass(frozen=True)
class HubertCTCModelConfig(CTCModelConfig, HubertCTCConfig):
    """`CTCModelConfig` (`init`, `vocab_size` from the data) on HuBERT's body
    (`HubertCTCConfig`): `init` is a pretext hubert workdir or model directory or a HF
    `HubertModel` / `HubertForCTC` folder."""


HUBERT_UPDATES, HUBERT_WARMUP, HUBERT_DECAY = 25000, 8000, 72000  # max_update, warmup/decay_steps
HUBERT_PRESETS = {  # fairseq examples/hubert/config/finetune/base_10h.yaml
    "ctc_hubert_base_10h": fairseq_recipe(
        HUBERT_UPDATES, 2e-5, 0.75, 0.5, 0.1, 10000, warmup=HUBERT_WARMUP, hold=0,
        # fairseq decays over 72,000 updates and stops 17,000 into them: the rate there.
        end_scale=math.exp(math.log(0.05) * (HUBERT_UPDATES - HUBERT_WARMUP) / HUBERT_DECAY),
        rows=8),  # max_tokens 3,200,000 on one GPU (distributed_world_size 1), update_freq 1
}
HUBERT_RECIPE_PRESET = "ctc_hubert_base_10h"
HUBERT_NETWORK_FIELDS = (*(f.name for f in dataclasses.fields(SpeechEncoderConfig)
                           if f.name not in HUBERT_PRESETS[HUBERT_RECIPE_PRESET]["model"]),
                         "feature_projection_layer_norm")


def hubert_ctc_recipe(pretrained: Any, task: DownstreamTask, source_config: Mapping[str, Any]
                      ) -> FinetuneRecipe | None:
    """HuBERT (pre-trained or fine-tuned) on task `ctc`: the starting network's sizes and
    fairseq's HuBERT base_10h recipe (25,000 updates at 2e-5, 8,000 warmup, the context
    network frozen for the first 10,000)."""
    if task.name != CTC or not isinstance(pretrained, (Hubert, HubertForCTC)):
        return None
    return body_recipe(pretrained, HUBERT_CTC, HUBERT_PRESETS, HUBERT_RECIPE_PRESET,
                       HUBERT_NETWORK_FIELDS)


HUBERT_METHOD = register(dataclasses.replace(
    METHOD, name=HUBERT_CTC, model_config=HubertCTCModelConfig, presets=HUBERT_PRESETS,
    description="Fine-tuning: speech recognition with CTC on HuBERT (WER, CER)",
    start=Start(hf_models=(HubertForCTC,), pretrained=pretrained_ctc,
                finetunes=hubert_ctc_recipe),
))
