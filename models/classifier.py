"""Sentence(-pair) classification and regression on the shared encoder, for fine-tuning (GLUE).

Two heads, each as its reference builds it:
- `bert`: the pooler (dense + tanh on [CLS]), dropout, dense to the labels (google-research/bert
  run_classifier.py `create_model`; HF `BertForSequenceClassification`).
- `electra`: on [CLS]: dropout, dense(H), GELU, dropout, dense to the labels (HF
  `ElectraClassificationHead`, the parity oracle; the TF ELECTRA code uses a tanh pooler there).
`num_labels=1` is regression (STS-B). The encoder is the one BERT and ELECTRA pre-train, so a
pre-trained model's weights move over unchanged (`from_pretrained`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from models.bert import Bert
from models.electra import ElectraDiscriminator
from models.encoder import ACTIVATIONS, Encoder, EncoderConfig, dense, dropout

HEADS = ("bert", "electra")


@dataclasses.dataclass(frozen=True)
class ClassifierConfig(EncoderConfig):
    """The encoder's config plus the head: `head` (bert | electra), `num_labels` (1 =
    regression) and `classifier_dropout` (< 0: the encoder's hidden_dropout, as HF)."""

    head: str = "bert"
    num_labels: int = 2
    classifier_dropout: float = -1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head not in HEADS:
            raise ValueError(f"head={self.head!r} must be one of {HEADS}")
        if self.num_labels < 1:
            raise ValueError(f"num_labels={self.num_labels} must be >= 1 (1 = regression)")

    @property
    def head_dropout(self) -> float:
        return self.hidden_dropout if self.classifier_dropout < 0 else self.classifier_dropout


class SequenceClassifier(nnx.Module):
    """Encoder + classification head; returns logits [B, num_labels]."""

    def __init__(self, config: ClassifierConfig, *, rngs: nnx.Rngs):
        h = config.hidden_size
        self.config = config
        with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
            self.encoder = Encoder(config, rngs=rngs)
            self.head_dense = dense(config, h, h, ("embed", "mlp"), rngs)
            self.head_output = dense(config, h, config.num_labels, ("mlp", None), rngs)

    def __call__(
        self,
        input_ids: jax.Array,
        token_type_ids: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        *,
        rng: jax.Array | None = None,
    ) -> jax.Array:
        encoder_rng, first_rng, second_rng = (jax.random.split(rng, 3) if rng is not None
                                              else (None, None, None))
        first_token = self.encoder(input_ids, token_type_ids, attention_mask, encoder_rng)[:, 0]
        rate = self.config.head_dropout
        if self.config.head == "bert":
            pooled = jnp.tanh(self.head_dense(first_token))
            return self.head_output(dropout(pooled, rate, first_rng))
        x = self.head_dense(dropout(first_token, rate, first_rng))
        x = ACTIVATIONS["gelu"](x)
        return self.head_output(dropout(x, rate, second_rng))


def classifier_config(pretrained: Bert | ElectraDiscriminator, num_labels: int,
                      classifier_dropout: float = -1.0) -> ClassifierConfig:
    """The classifier config for a pre-trained BERT (bert head) or ELECTRA discriminator
    (electra head)."""
    head = "bert" if isinstance(pretrained, Bert) else "electra"
    fields = {f.name: getattr(pretrained.config, f.name)
              for f in dataclasses.fields(EncoderConfig)}
    return ClassifierConfig(**fields, head=head, num_labels=num_labels,
                            classifier_dropout=classifier_dropout)


def from_pretrained(pretrained: Bert | ElectraDiscriminator, config: ClassifierConfig,
                    rngs: nnx.Rngs) -> SequenceClassifier:
    """A classifier whose encoder (and, for BERT, pooler) are the pre-trained model's; the rest
    of the head is freshly initialised."""
    model = SequenceClassifier(config, rngs=rngs)
    nnx.update(model.encoder, nnx.state(pretrained.encoder, nnx.Param))
    if isinstance(pretrained, Bert):
        nnx.update(model.head_dense, nnx.state(pretrained.pooler, nnx.Param))
    return model
