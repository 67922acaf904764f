"""The transformer classifier's fine-tuning runs (methods `classify`, `tag` and `span`), shared
by the families whose encoders they fine-tune: the model config and the pre-trained encoder the
methods start from (`FinetuneModelConfig`, `load_encoder`); each family says its paper's
settings (`ClassifierSettings`) and declares them as its `registry.Start.finetunes` through
`claims_encoders`, so that `run.py finetune` / `glue` give a BERT, ELECTRA, RoBERTa, ALBERT,
MPNet, XLNet or XLM checkpoint its own paper's recipe. RoBERTa's and MPNet's GLUE recipe is one
(`fairseq_glue_settings`: MPNet's README repeats fairseq's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.models.classifier import (
    ENCODERS,
    HEADS,
    ClassifierConfig,
    HeadConfig,
    MPNetClassifierConfig,
    Pretrained,
    XLMClassifierConfig,
    XLNetClassifierConfig,
    classifier_config,
    head_of,
    longest_input,
)
from pretext_jax.objectives import registry
from pretext_jax.objectives.registry import DownstreamTask, FinetuneRecipe

CLASSIFY = "classify"  # the transformer classifier's method (objectives/classification.py)
# The heads whose network has a layer of its own per depth in models/encoder.py, where adapters
# go (`EncoderConfig.adapter_size`; ALBERT's one shared layer would share them across depths).
ADAPTER_HEADS = ("bert", "electra", "roberta")


@dataclasses.dataclass(frozen=True)
class ClassifierSettings:
    """A family's fine-tuning hyper-parameters for one encoder size and task (the optimizer's
    as `pretrain.config.OptimConfig` names them; the defaults are BERT's)."""

    learning_rate: float
    epochs: float
    weight_decay: float
    layerwise_lr_decay: float = 1.0
    schedule: str = "linear"
    batch_size: int = 32
    warmup: float = 0.1  # share of the steps
    eps: float = 1e-6  # Adam's epsilon
    eps_before_bias_correction: bool = False
    b2: float = 0.999
    decay_norms_and_biases: bool = False
    clip_norm: float = 1.0
    classifier_dropout: float = -1.0  # < 0: the encoder's hidden dropout
    max_seq_length: int = 0  # 0: the task's input length
    span_head: str = ""  # SQuAD's span head (models.span.SPAN_HEADS); "": the method's default
    beam_size: int = 0  # SQuAD's beam and joint heads: starts and ends kept; 0: the head's default


# fairseq's RoBERTa README.glue.md, per task: (lr, batch size); microsoft/MPNet's README.glue.md
# repeats the table. Tasks outside it take the large tasks' column (MNLI, QNLI, QQP, SST-2).
FAIRSEQ_GLUE = {"rte": (2e-5, 16), "mrpc": (1e-5, 16), "cola": (1e-5, 16), "stsb": (2e-5, 16),
                "sst2": (1e-5, 32)}


def fairseq_glue_settings(task: str) -> ClassifierSettings:
    """fairseq's `sentence_prediction` fine-tuning (examples/roberta/README.glue.md, which
    microsoft/MPNet's MPNet/README.glue.md repeats for MPNet): 10 epochs, the per-task lr and
    batch (`FAIRSEQ_GLUE`), warmup over 6 % of the updates then `polynomial_decay` to 0 from the
    peak (`linear_from_peak`), weight decay 0.1 on every parameter, fairseq's Adam (b2 0.98, eps
    1e-6 added before the bias correction), no clipping, and the classification head's
    `pooler_dropout` 0 (fairseq roberta/model.py `base_architecture`)."""
    learning_rate, batch_size = FAIRSEQ_GLUE.get(task, (1e-5, 32))
    return ClassifierSettings(
        learning_rate=learning_rate, epochs=10, weight_decay=0.1, batch_size=batch_size,
        warmup=0.06, schedule="linear_from_peak", eps_before_bias_correction=True, b2=0.98,
        decay_norms_and_biases=True, clip_norm=0.0, classifier_dropout=0.0)


@dataclasses.dataclass(frozen=True)
class FinetuneModelConfig(ClassifierConfig, XLNetClassifierConfig, XLMClassifierConfig,
                          MPNetClassifierConfig):
    """Any classifier (`ClassifierConfig` for the bert/electra/roberta/albert heads,
    `XLNetClassifierConfig` for xlnet, `XLMClassifierConfig` for xlm, `MPNetClassifierConfig`
    for mpnet; the other families' fields are unused) and `init`, where its encoder comes
    from."""

    heads: ClassVar[tuple[str, ...]] = HEADS
    head: str = "bert"
    init: str = ""
    """Start from: a pretext workdir/model dir or HF folder of a head's family; '' = random."""
    init_layers: str = ""
    """Keep only these layers of `init`'s encoder, e.g. 0,2,4 (LayerDrop's pruning before
    fine-tuning, Fan et al. 2020 §4; fairseq `encoder_layers_to_keep`): the model holds them,
    renumbered, and `num_layers` counts them; a pretext `init` of models/encoder.py's encoder
    only; '' = all."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.adapter_size and self.head not in ADAPTER_HEADS:
            raise ValueError(f"adapter_size={self.adapter_size}: adapters sit in the layers of "
                             f"models/encoder.py ({', '.join(ADAPTER_HEADS)} heads), one per "
                             f"layer; set model.adapter_size=0 for head={self.head}")

    @property
    def is_xlm(self) -> bool:
        return self.head == "xlm"


def read_pretrained(init: str, load: Callable[..., nnx.Module], layers_to_keep: str = ""
                    ) -> nnx.Module:
    """The model of `init`, a pretext workdir/model directory or a HuggingFace folder, read by
    `load` (the trainer's checkpoint loader, `pretrain.loading.load_pretrained`: the checkpoint
    formats live with the trainer), its encoder pruned to `layers_to_keep` ('' = all; a pretext
    `init` only)."""
    if not Path(init).is_dir():
        raise UserError(f"model.init={init} is not a directory; pass a pretext workdir, a "
                        "model directory or a HuggingFace BERT/ELECTRA/RoBERTa/ALBERT/MPNet/"
                        "XLNet/XLM folder")
    return load(init, layers_to_keep=layers_to_keep) if layers_to_keep else load(init)


def as_encoder(init: str, model: nnx.Module, head: str = "") -> nnx.Module:
    """`init`'s model as the encoder of a `head` (any head when ''): a pre-trained model of a
    head's family, or a fine-tuned model with a head (whose encoder is reused), whose network
    is the one `head` sits on (`models.classifier.ENCODERS`)."""
    found = head_of(model)
    if found is None:
        raise UserError(f"{init} holds a {type(model).__name__}; this classifier starts from "
                        "BERT, an ELECTRA discriminator, RoBERTa, ALBERT, MPNet, XLNet or XLM "
                        f"(`run.py finetune --init {init}` picks the method that fine-tunes what "
                        "it holds, if any)")
    if head and ENCODERS[found] != ENCODERS[head]:
        raise UserError(f"{init} holds a {type(model).__name__} (head {found}); model.head="
                        f"{head} starts from that head's family: use model.head={found} or "
                        "another --init")
    return model


def load_encoder(init: str, load: Callable[..., nnx.Module], head: str = "",
                 layers_to_keep: str = "") -> nnx.Module:
    """The pre-trained encoder to start a `head` from (`read_pretrained`, `as_encoder`), pruned
    to `layers_to_keep` ('' = all)."""
    return as_encoder(init, read_pretrained(init, load, layers_to_keep), head)


# The input layout each head reads (`input_pipeline.glue.LAYOUTS`); the others read BERT's.
HEAD_LAYOUTS = {"xlnet": "xlnet", "xlm": "xlm", "roberta": "roberta", "mpnet": "roberta"}


def layout_of(head: str) -> str:
    """The GLUE input layout a head reads (`input_pipeline.glue.LAYOUTS`)."""
    return HEAD_LAYOUTS.get(head, "bert")


def check_input_length(model: HeadConfig, max_seq_length: int) -> None:
    """`examples.max_seq_length` fits the head's positions (`longest_input`)."""
    longest = longest_input(model)
    if longest is not None and max_seq_length > longest:
        raise UserError(f"examples.max_seq_length={max_seq_length} exceeds the {longest} "
                        f"positions of the model (max_position_embeddings="
                        f"{model.max_position_embeddings}); lower it")


def claims_encoders(head: str, settings: Callable[[int, str], ClassifierSettings]
                    ) -> Callable[[Any, DownstreamTask, Mapping[str, Any]],
                                  FinetuneRecipe | None]:
    """A `Start.finetunes` that claims the pre-trained encoders (and fine-tuned classifiers)
    whose classifier head is `head`, fine-tuned by the task's method (`classify` for GLUE,
    `span` for SQuAD, where that method's model config lists the head in its `heads`)
    with `settings(hidden_size, task name)`, the family's recipe, at the task's input length
    (else 128), and the tokenizer the encoder was trained with."""

    def finetunes(model: Any, task: DownstreamTask, source_config: Mapping[str, Any]
                  ) -> FinetuneRecipe | None:
        del source_config
        if not isinstance(model, Pretrained):
            return None
        config = classifier_config(model, task.num_labels)
        if config.head != head or head not in getattr(
                registry.get(task.method).model_config, "heads", ()):
            return None  # not this family's, or the task's method has no head for it (or none
            # at all: summarisation's encoder-decoders)
        chosen = settings(config.hidden_size, task.name)
        fields = {**dataclasses.asdict(config), "classifier_dropout": chosen.classifier_dropout}
        length = chosen.max_seq_length or task.max_seq_length or 128
        if longest_input(config) is not None:  # XLNet's relative positions: no limit
            length = min(length, longest_input(config))
        values = {"method": task.method, **{f"model.{k}": v for k, v in fields.items()},
                  "examples.max_seq_length": length,
                  "examples.layout": layout_of(head),
                  "train.batch_size": chosen.batch_size,
                  "optim.learning_rate": chosen.learning_rate,
                  "optim.weight_decay": chosen.weight_decay,
                  "optim.layerwise_lr_decay": chosen.layerwise_lr_decay,
                  "optim.schedule": chosen.schedule, "optim.bias_correction": True,
                  "optim.eps_before_bias_correction": chosen.eps_before_bias_correction,
                  "optim.eps": chosen.eps, "optim.b2": chosen.b2,
                  "optim.decay_norms_and_biases": chosen.decay_norms_and_biases,
                  "optim.clip_norm": chosen.clip_norm}
        if chosen.span_head:
            values["model.span_head"] = chosen.span_head
        if chosen.beam_size:
            values["model.start_n_top"] = values["model.end_n_top"] = chosen.beam_size
        return FinetuneRecipe(values, epochs=chosen.epochs, warmup=chosen.warmup,
                              tokenizer_from_init=True)

    return finetunes
