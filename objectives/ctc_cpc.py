"""Speech recognition by CTC on CPC's context network (van den Oord et al. 2018 §3.1), method
`ctc_cpc`: `run.py finetune --task ctc --init <a CPC run>` chooses it. CPC's paper measures
phones with a linear classifier on c_t; here that layer (`models.cpc.CPCForCTC`) is trained with
the CTC loss over characters, with the whole network (`objective.trainable=all`), g_ar and the
layer (`context`) or the layer alone on frozen features (`head`, the paper's linear setting).
The loss, greedy decoding, data and WER are `objectives.common.ctc`'s, as for wav2vec 2.0.

The recipe is ours (the CPC paper fine-tunes nothing; CPC_audio's CTC phone evaluation is a
separate script): Adam at CPC's pre-training rate 2e-4 with 10 % warmup and linear decay, no
weight decay, batch 8, 20 epochs, the batch loss the mean over its utterances (fairseq's
`sentence_avg`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.models.cpc import CPC, TRAINABLE, CPCConfig, CPCCTCConfig, CPCForCTC
from pretext_jax.objectives.common.ctc import (
    CTC,
    CTC_REDUCTIONS,
    CTCExampleConfig,
    ctc_loss,
    prepare_ctc,
    wer_monitor,
)
from pretext_jax.objectives.registry import (
    Batch,
    DownstreamTask,
    Evaluation,
    FinetuneRecipe,
    Method,
    Metrics,
    Start,
    register,
)

NAME = "ctc_cpc"
NETWORK_FIELDS = tuple(f.name for f in dataclasses.fields(CPCConfig) if f.name != "dtype")


@dataclasses.dataclass(frozen=True)
class CPCCTCModelConfig(CPCCTCConfig):
    """The fine-tuned network and where it starts: `init`, a pretext CPC workdir or model
    directory ("" = random)."""

    init: str = ""
    """The pre-trained CPC whose g_enc and g_ar the run starts from."""
    vocab_size: int = 0
    """Output classes; 0 = the vocabulary's size, set from the data."""

    def __post_init__(self) -> None:
        if self.vocab_size:
            super().__post_init__()
        else:  # the data sets it before the model is built
            CPCConfig.__post_init__(self)


@dataclasses.dataclass(frozen=True)
class CPCCTCObjectiveConfig:
    """What trains and how the batch loss is reduced."""

    trainable: str = "all"
    """all, context (g_enc frozen) or head (the output layer alone on frozen c_t)."""
    reduction: str = "sentences"
    """mean, sentences, tokens or sum (`objectives.common.ctc.CTC_REDUCTIONS`)."""

    def __post_init__(self) -> None:
        if self.trainable not in TRAINABLE:
            raise ValueError(f"trainable={self.trainable!r} must be one of {TRAINABLE}")
        if self.reduction not in CTC_REDUCTIONS:
            raise ValueError(f"reduction={self.reduction!r} must be one of {CTC_REDUCTIONS}")


def cpc_ctc_loss(model: CPCForCTC, batch: Batch, rng: jax.Array | None, *,
                 objective: CPCCTCObjectiveConfig) -> tuple[jax.Array, Metrics]:
    """The CTC loss of a transcribed batch (`audio`, `attention_mask`, `labels` padded with -1);
    gradients reach only `objective.trainable`'s part."""
    logits, frames = model(batch["audio"], batch["attention_mask"], rng, objective.trainable)
    loss, per_utterance = ctc_loss(logits, frames, batch["labels"],
                                   blank_id=model.config.blank_id, reduction=objective.reduction)
    rows = jnp.ones((), jnp.float32) * per_utterance.shape[0]
    return loss, {"loss": (loss * rows, rows)}


def build_cpc_ctc(config: CPCCTCModelConfig, seed: int) -> CPCForCTC:
    with nnx.use_eager_sharding(False):
        return CPCForCTC(config, rngs=nnx.Rngs(seed))


def pretrained_cpc_ctc(config: CPCCTCModelConfig, seed: int,
                       load: Callable[[str], nnx.Module]) -> CPCForCTC | None:
    """A fresh output layer on the CPC network of `config.init` (None: random init)."""
    if not config.init:
        return None
    pretrained = load(config.init)
    if not isinstance(pretrained, CPC):
        raise UserError(f"model.init={config.init} holds a {type(pretrained).__name__}; "
                        f"{NAME} starts from a pretext CPC run")
    differing = [name for name in NETWORK_FIELDS
                 if getattr(pretrained.config, name) != getattr(config, name)]
    if differing:
        raise UserError(f"model.init={config.init}: model.{differing[0]} is "
                        f"{getattr(pretrained.config, differing[0])} there, "
                        f"{getattr(config, differing[0])} here; leave the model sizes to run.py "
                        "finetune, which copies them from the starting point")
    model = build_cpc_ctc(config, seed)
    model.cpc = pretrained
    return model


RECIPE = {"optim.optimizer": "adamw", "optim.learning_rate": 2e-4, "optim.schedule": "linear",
          "optim.weight_decay": 0.0, "optim.bias_correction": True, "optim.eps": 1e-8,
          "optim.clip_norm": 0.0, "train.batch_size": 8}


def cpc_ctc_recipe(pretrained: Any, task: DownstreamTask, source_config: Mapping[str, Any]
                   ) -> FinetuneRecipe | None:
    """A CPC network on task `ctc`: its sizes and `RECIPE` for 20 epochs, 10 % warmup."""
    if task.name != CTC or not isinstance(pretrained, CPC):
        return None
    network = {f"model.{name}": getattr(pretrained.config, name) for name in NETWORK_FIELDS}
    return FinetuneRecipe(values={"method": NAME, **{k: list(v) if isinstance(v, tuple) else v
                                                      for k, v in network.items()}, **RECIPE},
                          epochs=20, warmup=0.1)


METHOD = register(Method(
    name=NAME,
    model_config=CPCCTCModelConfig,
    example_config=CTCExampleConfig,
    objective_config=CPCCTCObjectiveConfig,
    build_model=build_cpc_ctc,
    loss=cpc_ctc_loss,
    prepare=prepare_ctc,
    units_per_example=lambda examples: examples.max_samples,
    unit="samples",
    description="Fine-tuning: speech recognition with CTC on CPC's context network (WER, CER)",
    evaluation=Evaluation(monitor=wer_monitor),
    start=Start(pretrained=pretrained_cpc_ctc, finetunes=cpc_ctc_recipe),
))
