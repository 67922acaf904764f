"""Sentence(-pair) classification and regression on a pre-trained encoder, for fine-tuning
(GLUE).

The heads, each as its reference builds it:
- `bert` and `albert`: the pooler (dense + tanh on [CLS]), dropout, dense to the labels
  (google-research/bert run_classifier.py `create_model`, google-research/albert
  classifier_utils.py `create_model`; HF `BertForSequenceClassification`,
  `AlbertForSequenceClassification`).
- `electra`: on [CLS]: dropout, dense(H), GELU, dropout, dense to the labels (HF
  `ElectraClassificationHead`, the parity oracle; the TF ELECTRA code uses a tanh pooler there).
- `roberta` and `mpnet`: the same on <s> with tanh (fairseq `RobertaClassificationHead`, which
  microsoft/MPNet's fine-tuning reuses; HF `RobertaClassificationHead`,
  `MPNetClassificationHead`).
- `xlnet`: on the last position (the <cls> that ends XLNet's inputs, which are padded on the
  left): dense + tanh, dropout, dense to the labels (zihangdai/xlnet modeling.py
  `summarize_sequence` with summary_type `last` and `use_proj`, then `classification_loss`;
  HF `XLNetForSequenceClassification`: `sequence_summary`, `logits_proj`).
- `xlm`: on the first position (the </s> that opens XLM's inputs): dropout, dense to the labels
  (facebookresearch/XLM xlm/evaluation/glue.py `proj` on `get_embeddings`; HF
  `XLMForSequenceClassification`: `sequence_summary` with summary_type `first`).
`num_labels=1` is regression (STS-B). Each head sits on the network its family pre-trains
(`EncoderHeads`): the shared `Encoder` (BERT, ELECTRA, RoBERTa; ALBERT's with its one shared
layer), `XLNetModel`, `XLM` without its prediction layer, `MPNet` without its LM head, so a
pre-trained model's weights move over unchanged (`from_pretrained`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.models.albert import Albert
from pretext_jax.models.bert import Bert
from pretext_jax.models.electra import ElectraDiscriminator
from pretext_jax.models.encoder import Encoder, EncoderConfig
from pretext_jax.models.layers import ACTIVATIONS, TransformerConfig, dense, dropout, split_rng
from pretext_jax.models.mpnet import POSITION_OFFSET, MPNet, MPNetConfig
from pretext_jax.models.roberta import Roberta
from pretext_jax.models.xlm import XLM, XLMConfig
from pretext_jax.models.xlnet import XLNet, XLNetConfig, XLNetModel

HEADS = ("bert", "electra", "roberta", "albert", "mpnet", "xlnet", "xlm")
# The pre-trained models each head's family makes (a subclass finds its family's entry).
FAMILIES = {Bert: "bert", ElectraDiscriminator: "electra", Roberta: "roberta", Albert: "albert",
            MPNet: "mpnet", XLNet: "xlnet", XLM: "xlm"}
# The network under each head (`EncoderHeads`): heads with one entry start from each other's
# pre-trained models (the shared `Encoder`; ALBERT's stores one shared layer; a family's own).
ENCODERS = {"bert": "encoder", "electra": "encoder", "roberta": "encoder",
            "albert": "shared encoder", "mpnet": "mpnet", "xlnet": "xlnet", "xlm": "xlm"}
# The two-layer heads (dropout, dense, activation, dropout, dense) and their activation; the
# pooler heads (dense, tanh, dropout, dense) are the rest but XLM's (dropout, dense).
TWO_LAYER_ACTIVATIONS = {"electra": ACTIVATIONS["gelu"], "roberta": jnp.tanh,
                         "mpnet": jnp.tanh}


@dataclasses.dataclass(frozen=True)
class HeadConfig(TransformerConfig):
    """The head's fields: `head` (one of the class's `heads`), `num_labels` (1 = regression)
    and `classifier_dropout` (< 0: the encoder's hidden_dropout, as HF)."""

    heads: ClassVar[tuple[str, ...]] = HEADS
    head: str = "bert"
    """Head (and the family whose network it sits on): bert or albert (tanh pooler), electra
    (HF `ElectraClassificationHead`), roberta or mpnet (its tanh form), xlnet (last token), xlm
    (first token, one linear layer)."""
    num_labels: int = 2
    """Outputs of the head: classes, or 1 for regression (STS-B); must match the task; 0 = from
    the data (NER: the training file's tags)."""
    classifier_dropout: float = -1.0
    """Head dropout; < 0 = hidden_dropout (HF `classifier_dropout`, XLNet summary_last_dropout)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head not in self.heads:
            raise ValueError(f"head={self.head!r} must be one of {self.heads}")
        if self.num_labels < 0:
            raise ValueError(f"num_labels={self.num_labels} must be >= 1 (1 = regression), or 0 "
                             "to take it from the data")

    @property
    def head_dropout(self) -> float:
        return self.hidden_dropout if self.classifier_dropout < 0 else self.classifier_dropout


@dataclasses.dataclass(frozen=True)
class ClassifierConfig(EncoderConfig, HeadConfig):
    """The BERT-style encoder's config plus a bert, electra, roberta or albert head."""

    heads: ClassVar[tuple[str, ...]] = ("bert", "electra", "roberta", "albert")


@dataclasses.dataclass(frozen=True)
class XLNetClassifierConfig(XLNetConfig, HeadConfig):
    """XLNet's config plus the xlnet head (`classifier_dropout` is HF's
    `summary_last_dropout`)."""

    heads: ClassVar[tuple[str, ...]] = ("xlnet",)
    head: str = "xlnet"


@dataclasses.dataclass(frozen=True)
class XLMClassifierConfig(XLMConfig, HeadConfig):
    """XLM's config plus the xlm head (`classifier_dropout` is HF's `summary_first_dropout`)."""

    heads: ClassVar[tuple[str, ...]] = ("xlm",)
    head: str = "xlm"


@dataclasses.dataclass(frozen=True)
class MPNetClassifierConfig(MPNetConfig, HeadConfig):
    """MPNet's config plus the mpnet head (HF's heads drop out at `hidden_dropout_prob`)."""

    heads: ClassVar[tuple[str, ...]] = ("mpnet",)
    head: str = "mpnet"


def longest_input(config: HeadConfig) -> int | None:
    """The most tokens the head's network has positions for: None for XLNet's relative
    positions; MPNet's table less the 2 rows before the first position; RoBERTa's less its
    padding id + 1 (positions count from there); else the table's rows."""
    if config.head == "xlnet":
        return None
    if config.head == "mpnet":
        return config.max_position_embeddings - POSITION_OFFSET
    padding_id = getattr(config, "position_padding_id", -1)
    return config.max_position_embeddings - (padding_id + 1 if padding_id >= 0 else 0)


class EncoderHeads(nnx.Module):
    """What the heads share: the network of the head's family (`ENCODERS`) and its final
    states. XLNet's runs on the content stream alone (no memory, permutation mask or target
    mapping), XLM's bidirectionally without language ids or token types (as XLM's GLUE
    fine-tuning runs it), MPNet's without token types (it has none)."""

    def _build_encoder(self, config: HeadConfig, rngs: nnx.Rngs) -> None:
        if config.head == "xlnet":
            self.transformer = XLNetModel(config, rngs=rngs)
        elif config.head == "xlm":
            self.transformer = XLM(config, rngs=rngs, with_output=False)
        elif config.head == "mpnet":
            self.transformer = MPNet(config, rngs=rngs, with_lm_head=False)
        else:
            self.encoder = Encoder(config, rngs=rngs, shared_layers=config.head == "albert")

    def hidden(self, input_ids: jax.Array, token_type_ids: jax.Array | None,
               attention_mask: jax.Array | None, rng: jax.Array | None) -> jax.Array:
        """The final states [B, T, H]."""
        head = self.config.head
        if head == "xlnet":
            return self.transformer.encode(input_ids, token_type_ids, attention_mask, rng=rng)[0]
        if head == "xlm":
            return self.transformer.hidden(input_ids, attention_mask, rng=rng)
        if head == "mpnet":
            return self.transformer.encode(input_ids, attention_mask, rng=rng)
        return self.encoder(input_ids, token_type_ids, attention_mask, rng)


class SequenceClassifier(EncoderHeads):
    """Encoder + classification head; returns logits [B, num_labels] (the heads: the module
    docstring)."""

    def __init__(self, config: HeadConfig, *, rngs: nnx.Rngs):
        h = config.hidden_size
        self.config = config
        with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
            self._build_encoder(config, rngs)
            self.head_dense = (None if config.head == "xlm"
                               else dense(config, h, h, ("embed", "mlp"), rngs))
            self.head_output = dense(config, h, config.num_labels, ("mlp", None), rngs)

    def __call__(
        self,
        input_ids: jax.Array,
        token_type_ids: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        *,
        rng: jax.Array | None = None,
    ) -> jax.Array:
        return self.head_output(self.features(input_ids, token_type_ids, attention_mask, rng))

    def features(self, input_ids: jax.Array, token_type_ids: jax.Array | None,
                 attention_mask: jax.Array | None, rng: jax.Array | None) -> jax.Array:
        """What the output layer reads [B, H]: the summary token through the head's layers
        before its last, after the head's dropout."""
        encoder_rng, first_rng, second_rng = split_rng(rng, 3)
        hidden = self.hidden(input_ids, token_type_ids, attention_mask, encoder_rng)
        return self.summary(hidden, first_rng, second_rng)

    def logits(self, hidden: jax.Array, first_rng: jax.Array | None,
               second_rng: jax.Array | None) -> jax.Array:
        """The head on the final states [B, T, H] -> [B, num_labels] (TinyBERT reads both
        networks' states and logits in one pass)."""
        return self.head_output(self.summary(hidden, first_rng, second_rng))

    def summary(self, hidden: jax.Array, first_rng: jax.Array | None,
                second_rng: jax.Array | None) -> jax.Array:
        """What the output layer reads [B, H] from the final states [B, T, H]: the summary
        token through the head's layers before its last; the keys drop out before its first
        and second layer."""
        head, rate = self.config.head, self.config.head_dropout
        # XLNet's <cls> ends the (left-padded) input; the others' first token opens it
        summary_token = hidden[:, -1] if head == "xlnet" else hidden[:, 0]
        if head == "xlm":
            return dropout(summary_token, rate, first_rng)
        if head in TWO_LAYER_ACTIVATIONS:
            x = self.head_dense(dropout(summary_token, rate, first_rng))
            return dropout(TWO_LAYER_ACTIVATIONS[head](x), rate, second_rng)
        return dropout(jnp.tanh(self.head_dense(summary_token)), rate, first_rng)


@dataclasses.dataclass(frozen=True)
class MultiHeadConfig(ClassifierConfig):
    """A classifier with one output layer per task: `task_labels` (each task's outputs, 1 =
    regression), on the bert/electra/roberta/albert heads' encoder."""

    task_labels: tuple[int, ...] | None = None
    """Outputs of each task's layer, in the order of the tasks; None = from the data."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.task_labels is not None:  # a JSON list read back
            object.__setattr__(self, "task_labels", tuple(int(n) for n in self.task_labels))


class MultiHeadClassifier(SequenceClassifier):
    """One encoder and the head's layers before its last shared by every task, one output
    layer per task (MT-DNN, Liu et al. 2019 §3: the shared lexicon and transformer encoders,
    a task-specific output layer; namisan/mt-dnn mt_dnn/matcher.py `SANBertNetwork`: BERT's
    pooler, then `scoring_list[task_id]`). Returns every task's logits, padded to the widest
    task's outputs [B, tasks, max labels]. A classifier started from it takes its encoder and
    the shared layers (`from_pretrained`), a fresh output layer."""

    def __init__(self, config: MultiHeadConfig, *, rngs: nnx.Rngs):
        h = config.hidden_size
        self.config = config
        with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
            self._build_encoder(config, rngs)
            self.head_dense = (None if config.head == "xlm"
                               else dense(config, h, h, ("embed", "mlp"), rngs))
            self.task_outputs = nnx.List([dense(config, h, labels, ("mlp", None), rngs)
                                          for labels in config.task_labels])

    def __call__(
        self,
        input_ids: jax.Array,
        token_type_ids: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        *,
        rng: jax.Array | None = None,
    ) -> jax.Array:
        x = self.features(input_ids, token_type_ids, attention_mask, rng)
        widest = max(self.config.task_labels)
        return jnp.stack([jnp.pad(output(x), ((0, 0), (0, widest - labels)))
                          for output, labels in zip(self.task_outputs, self.config.task_labels,
                                                    strict=True)], axis=1)


class TokenClassifier(EncoderHeads):
    """Encoder + a linear layer over every final state (after dropout): logits [B, T,
    num_labels], for token classification (named entities; BERT §5.3: the first sub-token of
    each word labelled). HF `*ForTokenClassification` of every family: `classifier` on the
    sequence output. The encoders sit where `SequenceClassifier` keeps them, so
    `from_pretrained` serves both."""

    def __init__(self, config: HeadConfig, *, rngs: nnx.Rngs):
        self.config = config
        with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
            self._build_encoder(config, rngs)
            self.head_output = dense(config, config.hidden_size, config.num_labels,
                                     ("mlp", None), rngs)

    def __call__(
        self,
        input_ids: jax.Array,
        token_type_ids: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        *,
        rng: jax.Array | None = None,
    ) -> jax.Array:
        encoder_rng, head_rng = split_rng(rng, 2)
        hidden = self.hidden(input_ids, token_type_ids, attention_mask, encoder_rng)
        return self.head_output(dropout(hidden, self.config.head_dropout, head_rng))


Pretrained = (Bert | ElectraDiscriminator | Roberta | Albert | MPNet | XLNet | XLM
              | SequenceClassifier | TokenClassifier)


def head_of(model: Any) -> str | None:
    """The head a model fine-tunes with: its own for a model with a head config (a fine-tuned
    classifier or span extractor), else its family's (`FAMILIES`); None for other models."""
    if isinstance(getattr(model, "config", None), HeadConfig):
        return model.config.head
    return next((FAMILIES[c] for c in type(model).__mro__ if c in FAMILIES), None)


def classifier_config(pretrained: Pretrained, num_labels: int, classifier_dropout: float = -1.0
                      ) -> HeadConfig:
    """The classifier config for a pre-trained model of a family in `FAMILIES` (its head) or a
    fine-tuned classifier (its head). XLNet fine-tunes without memory, `bi_data` or
    `same_length`, as run_classifier.py's run config (xlnet.py `create_run_config` with
    is_finetune); XLM bidirectionally, whatever it was pre-trained with (glue.py:
    `causal=False`)."""
    config, head = pretrained.config, head_of(pretrained)
    if head == "xlm":
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(XLMConfig)}
        fields.update(causal=False, is_decoder=False)
        return XLMClassifierConfig(**fields, num_labels=num_labels,
                                   classifier_dropout=classifier_dropout)
    if head == "xlnet":
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(XLNetConfig)}
        fields.update(bi_data=False, same_length=False, mem_len=0, reuse_len=0,
                      memory_batch_size=0)
        return XLNetClassifierConfig(**fields, num_labels=num_labels,
                                     classifier_dropout=classifier_dropout)
    if head == "mpnet":
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(MPNetConfig)}
        return MPNetClassifierConfig(**fields, num_labels=num_labels,
                                     classifier_dropout=classifier_dropout)
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(EncoderConfig)}
    return ClassifierConfig(**fields, head=head, num_labels=num_labels,
                            classifier_dropout=classifier_dropout)


def copy_params(target: nnx.Module, source: nnx.Module) -> None:
    """Sets `target`'s parameters to `source`'s of the same names (`source` may have more,
    e.g. XLNet's LM bias)."""
    params = nnx.state(source, nnx.Param)
    nnx.update(target, nnx.State({name: params[name] for name in nnx.state(target, nnx.Param)}))


def move_encoder(model: EncoderHeads, pretrained: nnx.Module) -> None:
    """Sets `model`'s network to `pretrained`'s (a pre-trained model or a model with a head
    over the same network, `ENCODERS`): the shared `Encoder` whole, the others all but their
    pre-training head's parameters."""
    if hasattr(model, "transformer"):
        copy_params(model.transformer, getattr(pretrained, "transformer", pretrained))
    else:
        nnx.update(model.encoder, nnx.state(pretrained.encoder, nnx.Param))


def from_pretrained(pretrained: Pretrained, config: HeadConfig, rngs: nnx.Rngs,
                    model_class: type[SequenceClassifier | TokenClassifier] = SequenceClassifier
                    ) -> SequenceClassifier | TokenClassifier:
    """A `model_class` (sequence or token classifier) whose encoder (and, for a sequence
    classifier with a pooler head from BERT or ALBERT, the pooler) are the pre-trained
    model's; the rest of the head is freshly initialised. From a fine-tuned classifier, only
    its encoder moves over; from a multi-task one, its encoder and the layer its tasks share
    (pooler heads)."""
    model = model_class(config, rngs=rngs)
    move_encoder(model, pretrained)
    pooler = getattr(pretrained, "pooler", None)
    if isinstance(pretrained, MultiHeadClassifier) and pretrained.head_dense is not None:
        pooler = pretrained.head_dense  # the tasks' shared layer (MT-DNN §3's refinement)
    if isinstance(model, SequenceClassifier) and pooler is not None and config.head in (
            "bert", "albert"):
        nnx.update(model.head_dense, nnx.state(pooler, nnx.Param))
    return model
