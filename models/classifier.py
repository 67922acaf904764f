"""Sentence(-pair) classification and regression on a pre-trained encoder, for fine-tuning
(GLUE).

Three heads, each as its reference builds it:
- `bert`: the pooler (dense + tanh on [CLS]), dropout, dense to the labels (google-research/bert
  run_classifier.py `create_model`; HF `BertForSequenceClassification`).
- `electra`: on [CLS]: dropout, dense(H), GELU, dropout, dense to the labels (HF
  `ElectraClassificationHead`, the parity oracle; the TF ELECTRA code uses a tanh pooler there).
- `xlnet`: on the last position (the <cls> that ends XLNet's inputs, which are padded on the
  left): dense + tanh, dropout, dense to the labels (zihangdai/xlnet modeling.py
  `summarize_sequence` with summary_type `last` and `use_proj`, then `classification_loss`;
  HF `XLNetForSequenceClassification`: `sequence_summary`, `logits_proj`).
- `xlm`: on the first position (the </s> that opens XLM's inputs): dropout, dense to the labels
  (facebookresearch/XLM xlm/evaluation/glue.py `proj` on `get_embeddings`; HF
  `XLMForSequenceClassification`: `sequence_summary` with summary_type `first`).
`num_labels=1` is regression (STS-B). The bert and electra heads sit on the encoder BERT and
ELECTRA pre-train, the xlnet head on `XLNetModel`, the xlm head on `XLM` without its prediction
layer, so a pre-trained model's weights move over unchanged (`from_pretrained`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.models.bert import Bert
from pretext_jax.models.electra import ElectraDiscriminator
from pretext_jax.models.encoder import Encoder, EncoderConfig
from pretext_jax.models.layers import ACTIVATIONS, TransformerConfig, dense, dropout, split_rng
from pretext_jax.models.xlm import XLM, XLMConfig
from pretext_jax.models.xlnet import XLNet, XLNetConfig, XLNetModel

HEADS = ("bert", "electra", "xlnet", "xlm")


@dataclasses.dataclass(frozen=True)
class HeadConfig(TransformerConfig):
    """The head's fields: `head` (one of the class's `heads`), `num_labels` (1 = regression)
    and `classifier_dropout` (< 0: the encoder's hidden_dropout, as HF)."""

    heads: ClassVar[tuple[str, ...]] = HEADS
    head: str = "bert"
    """Head: bert (tanh pooler), electra (HF `ElectraClassificationHead`), xlnet (last token),
    xlm (first token, one linear layer)."""
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
    """The BERT-style encoder's config plus a bert or electra head."""

    heads: ClassVar[tuple[str, ...]] = ("bert", "electra")


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


class SequenceClassifier(nnx.Module):
    """Encoder + classification head; returns logits [B, num_labels]. The bert and electra
    heads sit on `Encoder` (`encoder`), the xlnet head on `XLNetModel` (`transformer`, run on
    the content stream alone: no memory, permutation mask or target mapping), the xlm head on
    `XLM` (`transformer`, bidirectional, without language ids or token types, as XLM's GLUE
    fine-tuning runs it)."""

    def __init__(self, config: HeadConfig, *, rngs: nnx.Rngs):
        h = config.hidden_size
        self.config = config
        with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
            if config.head == "xlnet":
                self.transformer = XLNetModel(config, rngs=rngs)
            elif config.head == "xlm":
                self.transformer = XLM(config, rngs=rngs, with_output=False)
            else:
                self.encoder = Encoder(config, rngs=rngs)
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
        encoder_rng, first_rng, second_rng = split_rng(rng, 3)
        rate = self.config.head_dropout
        if self.config.head == "xlnet":  # the <cls> that ends the (left-padded) input
            hidden, _ = self.transformer.encode(input_ids, token_type_ids, attention_mask,
                                                rng=encoder_rng)
            summary_token = hidden[:, -1]
        elif self.config.head == "xlm":  # the </s> that opens the input; token types unused
            summary_token = self.transformer.hidden(input_ids, attention_mask,
                                                    rng=encoder_rng)[:, 0]
            return self.head_output(dropout(summary_token, rate, first_rng))
        else:
            summary_token = self.encoder(input_ids, token_type_ids, attention_mask,
                                         encoder_rng)[:, 0]
        if self.config.head == "electra":
            x = self.head_dense(dropout(summary_token, rate, first_rng))
            x = ACTIVATIONS["gelu"](x)
            return self.head_output(dropout(x, rate, second_rng))
        pooled = jnp.tanh(self.head_dense(summary_token))
        return self.head_output(dropout(pooled, rate, first_rng))


class TokenClassifier(nnx.Module):
    """Encoder + a linear layer over every final state (after dropout): logits [B, T,
    num_labels], for token classification (named entities; BERT §5.3: the first sub-token of
    each word labelled). HF `BertForTokenClassification`, `ElectraForTokenClassification`,
    `XLNetForTokenClassification` and `XLMForTokenClassification`: `classifier` on the sequence
    output. The encoders sit where `SequenceClassifier` keeps them, so `from_pretrained` serves
    both."""

    def __init__(self, config: HeadConfig, *, rngs: nnx.Rngs):
        self.config = config
        with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
            if config.head == "xlnet":
                self.transformer = XLNetModel(config, rngs=rngs)
            elif config.head == "xlm":
                self.transformer = XLM(config, rngs=rngs, with_output=False)
            else:
                self.encoder = Encoder(config, rngs=rngs)
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
        if self.config.head == "xlnet":
            hidden, _ = self.transformer.encode(input_ids, token_type_ids, attention_mask,
                                                rng=encoder_rng)
        elif self.config.head == "xlm":  # token types unused, as in XLM's fine-tuning
            hidden = self.transformer.hidden(input_ids, attention_mask, rng=encoder_rng)
        else:
            hidden = self.encoder(input_ids, token_type_ids, attention_mask, encoder_rng)
        return self.head_output(dropout(hidden, self.config.head_dropout, head_rng))


Pretrained = Bert | ElectraDiscriminator | XLNet | XLM | SequenceClassifier | TokenClassifier


def classifier_config(pretrained: Pretrained, num_labels: int, classifier_dropout: float = -1.0
                      ) -> ClassifierConfig | XLNetClassifierConfig | XLMClassifierConfig:
    """The classifier config for a pre-trained BERT (bert head), ELECTRA discriminator (electra
    head), XLNet (xlnet head), XLM (xlm head) or fine-tuned classifier (its head). XLNet
    fine-tunes without memory, `bi_data` or `same_length`, as run_classifier.py's run config
    (xlnet.py `create_run_config` with is_finetune); XLM bidirectionally, whatever it was
    pre-trained with (glue.py: `causal=False`)."""
    config = pretrained.config
    head = (config.head if isinstance(pretrained, SequenceClassifier | TokenClassifier)
            else "xlnet" if isinstance(pretrained, XLNet)
            else "xlm" if isinstance(pretrained, XLM)
            else "bert" if isinstance(pretrained, Bert) else "electra")
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
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(EncoderConfig)}
    return ClassifierConfig(**fields, head=head, num_labels=num_labels,
                            classifier_dropout=classifier_dropout)


def copy_params(target: nnx.Module, source: nnx.Module) -> None:
    """Sets `target`'s parameters to `source`'s of the same names (`source` may have more,
    e.g. XLNet's LM bias)."""
    params = nnx.state(source, nnx.Param)
    nnx.update(target, nnx.State({name: params[name] for name in nnx.state(target, nnx.Param)}))


def from_pretrained(pretrained: Pretrained, config: HeadConfig, rngs: nnx.Rngs,
                    model_class: type[SequenceClassifier | TokenClassifier] = SequenceClassifier
                    ) -> SequenceClassifier | TokenClassifier:
    """A `model_class` (sequence or token classifier) whose encoder (and, for a sequence
    classifier from BERT, pooler) are the pre-trained model's; the rest of the head is freshly
    initialised. From a fine-tuned classifier, only its encoder moves over."""
    model = model_class(config, rngs=rngs)
    if config.head in ("xlnet", "xlm"):  # all but the pre-trained LM head's bias
        copy_params(model.transformer, getattr(pretrained, "transformer", pretrained))
        return model
    nnx.update(model.encoder, nnx.state(pretrained.encoder, nnx.Param))
    if isinstance(pretrained, Bert) and isinstance(model, SequenceClassifier):
        nnx.update(model.head_dense, nnx.state(pretrained.pooler, nnx.Param))
    return model
