"""ELECTRA: a small masked-LM generator and a replaced-token discriminator sharing embeddings.

Reference: google-research/electra run_pretraining.py (`PretrainingModel`,
`_get_masked_lm_output`, `_get_discriminator_output`) and configure_pretraining.py
(`get_generator_config`); Clark et al. 2020 §3.2. HF transformers modeling_electra.py
(`ElectraForPreTraining`, `ElectraForMaskedLM`) has the same parts and is the parity oracle.

`ElectraDiscriminator` and `ElectraGenerator` are complete models on their own (what HF
checkpoints hold, and what fine-tuning takes); `Electra` joins them for pre-training, the
generator reusing the discriminator's `Embeddings` module (token, position and type embeddings
and their LayerNorm), so those parameters exist once. Each side has its own projection from
`embedding_size` to its hidden size.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.models.encoder import Embeddings, Encoder, EncoderConfig
from pretext_jax.models.layers import ACTIVATIONS, MaskedLMHead, dense


@dataclasses.dataclass(frozen=True)
class ElectraConfig(EncoderConfig):
    """The discriminator's `EncoderConfig` plus the generator's size relative to it
    (configure_pretraining.py: `generator_hidden_size` 0.25 for Small, 1/3 for Base;
    `generator_layers` 1.0). The generator's FFN is 4x its hidden size and it has
    max(1, hidden // 64) heads (`get_generator_config`)."""

    embedding_size: int = 128
    generator_hidden_size: float = 0.25
    """Generator width as a fraction of the discriminator's, in (0, 1] (Small 0.25, Base 1/3)."""
    generator_layers: float = 1.0
    """Generator depth as a fraction of the discriminator's, in (0, 1] (ELECTRA 1.0)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.generator_hidden_size <= 1.0 or not 0.0 < self.generator_layers <= 1.0:
            raise ValueError(
                f"generator_hidden_size={self.generator_hidden_size} and generator_layers="
                f"{self.generator_layers} must be fractions of the discriminator's size in "
                "(0, 1], e.g. 0.25 (Small) or 0.3333 (Base) and 1.0")
        if self.layers_to_keep and self.generator_layers != 1.0:
            raise ValueError(f"layers_to_keep={self.layers_to_keep!r} prunes the generator's "
                             f"layers as the discriminator's, but generator_layers="
                             f"{self.generator_layers} gives it fewer; prune only an ELECTRA whose "
                             "generator_layers is 1.0")

    @classmethod
    def from_parts(cls, discriminator: EncoderConfig, generator: EncoderConfig
                   ) -> ElectraConfig:
        """The joint config of a separately stored discriminator and generator (e.g. HF's
        `google/electra-*-discriminator` and `-generator`); raises ValueError when the
        generator is not the one this config derives (4x FFN, max(1, hidden // 64) heads)."""
        fields = {f.name for f in dataclasses.fields(EncoderConfig)}
        config = cls(**{k: v for k, v in dataclasses.asdict(discriminator).items()
                        if k in fields},
                     generator_hidden_size=generator.hidden_size / discriminator.hidden_size,
                     generator_layers=generator.num_layers / discriminator.num_layers)
        derived = config.generator_config()
        if derived != dataclasses.replace(generator, embedding_size=generator.embedding_width):
            raise ValueError(
                f"the generator ({generator.num_heads} heads, FFN {generator.intermediate_size},"
                f" vocabulary {generator.vocab_size}) is not the one the discriminator implies "
                f"({derived.num_heads} heads, FFN {derived.intermediate_size}, vocabulary "
                f"{derived.vocab_size}); load the two parts separately")
        return config

    def discriminator_config(self) -> EncoderConfig:
        fields = {f.name for f in dataclasses.fields(EncoderConfig)}
        return EncoderConfig(**{k: v for k, v in dataclasses.asdict(self).items() if k in fields})

    def generator_config(self) -> EncoderConfig:
        hidden = max(1, round(self.hidden_size * self.generator_hidden_size))
        return dataclasses.replace(
            self.discriminator_config(), hidden_size=hidden, intermediate_size=4 * hidden,
            num_heads=max(1, hidden // 64),
            num_layers=max(1, round(self.num_layers * self.generator_layers)),
            embedding_size=self.embedding_width)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DiscriminatorOutput:
    """`hidden_states` [B, T, H] and per-token replaced-token logits `rtd_logits` [B, T]."""

    hidden_states: jax.Array
    rtd_logits: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GeneratorOutput:
    """`hidden_states` [B, T, H_gen] and `mlm_logits` [B, T, V] (or [B, P, V] at
    `masked_positions`)."""

    hidden_states: jax.Array
    mlm_logits: jax.Array


class ElectraDiscriminator(nnx.Module):
    """Encoder + replaced-token-detection head dense(H, act) -> dense(1) (HF
    `ElectraForPreTraining`; run_pretraining.py `_get_discriminator_output`)."""

    def __init__(self, config: EncoderConfig, *, rngs: nnx.Rngs,
                 embeddings: Embeddings | None = None):
        h = config.hidden_size
        self.config = config
        with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
            self.encoder = Encoder(config, rngs=rngs, embeddings=embeddings)
            self.rtd_transform = dense(config, h, h, ("embed", "mlp"), rngs)
            self.rtd_output = dense(config, h, 1, ("mlp", None), rngs)

    def __call__(
        self,
        input_ids: jax.Array,
        token_type_ids: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        *,
        rng: jax.Array | None = None,
    ) -> DiscriminatorOutput:
        hidden = self.encoder(input_ids, token_type_ids, attention_mask, rng)
        act = ACTIVATIONS[self.config.hidden_act]
        logits = self.rtd_output(act(self.rtd_transform(hidden)))[..., 0]
        return DiscriminatorOutput(hidden_states=hidden, rtd_logits=logits)


class ElectraGenerator(nnx.Module):
    """Encoder + masked-LM head (`MaskedLMHead` at `lm_head`): dense(H_gen -> E, act),
    LayerNorm, tied word embedding + bias (HF `ElectraForMaskedLM`; run_pretraining.py
    `_get_masked_lm_output`)."""

    def __init__(self, config: EncoderConfig, *, rngs: nnx.Rngs,
                 embeddings: Embeddings | None = None):
        self.config = config
        with nnx.use_eager_sharding(False):
            self.encoder = Encoder(config, rngs=rngs, embeddings=embeddings)
            self.lm_head = MaskedLMHead(config, rngs=rngs)

    def __call__(
        self,
        input_ids: jax.Array,
        token_type_ids: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        *,
        masked_positions: jax.Array | None = None,
        rng: jax.Array | None = None,
    ) -> GeneratorOutput:
        """`masked_positions` [B, P] gathers those positions before the vocabulary projection."""
        hidden = self.encoder(input_ids, token_type_ids, attention_mask, rng)
        return GeneratorOutput(
            hidden_states=hidden,
            mlm_logits=self.lm_head(hidden, self.encoder.embeddings.word_embeddings,
                                    masked_positions))


class Electra(nnx.Module):
    """Generator and discriminator for joint pre-training; the embeddings are the
    discriminator's, reused by the generator. `discriminator` alone is what fine-tuning uses
    (`downstream_model`)."""

    def __init__(self, config: ElectraConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.discriminator = ElectraDiscriminator(config.discriminator_config(), rngs=rngs)
        self.generator = ElectraGenerator(config.generator_config(), rngs=rngs,
                                          embeddings=self.discriminator.encoder.embeddings)

    def parts(self) -> dict[str, nnx.Module]:
        """The stand-alone models this one is made of, by name (exported separately)."""
        return {"discriminator": self.discriminator, "generator": self.generator}

    def load_parts(self, discriminator: ElectraDiscriminator,
                   generator: ElectraGenerator) -> None:
        """Copies the weights of stand-alone parts in; the shared embeddings come from the
        discriminator (a warning says so when the generator's differ)."""
        generator_embeddings = nnx.state(generator.encoder.embeddings, nnx.Param)
        discriminator_embeddings = nnx.state(discriminator.encoder.embeddings, nnx.Param)
        if not all(jax.tree.leaves(jax.tree.map(
                lambda a, b: bool(jnp.array_equal(a, b)), generator_embeddings,
                discriminator_embeddings))):
            warnings.warn("the generator's embeddings differ from the discriminator's; the "
                          "joint model shares one set and uses the discriminator's",
                          stacklevel=2)
        nnx.update(self.generator, nnx.state(generator, nnx.Param))
        nnx.update(self.discriminator, nnx.state(discriminator, nnx.Param))

    def downstream_model(self) -> ElectraDiscriminator:
        """The pre-trained model that fine-tuning starts from (Clark et al. 2020 §3.2: the
        generator is thrown out)."""
        return self.discriminator
