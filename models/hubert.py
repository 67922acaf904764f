"""HuBERT (Hsu et al. 2021) in Flax NNX: wav2vec 2.0's network (`models.wav2vec2`: the
convolutional feature encoder, the feature projection, the mask vector and the Transformer
context network, HF `HubertModel` being the same modules as `Wav2Vec2Model`) with HuBERT's
pre-training head: `final_proj`, a linear map of the context vectors to `final_dim`, and one
embedding per cluster (`label_embeddings`, fairseq `label_embs_concat`) that projected frames
are compared with by cosine similarity.

Reference: fairseq `models/hubert/hubert.py` (`HubertModel`: `layer_norm`, `post_extract_proj`,
`mask_emb`, `final_proj`, `label_embs_concat`, `compute_nce`) and HF transformers
modeling_hubert.py (`HubertModel`), whose weights convert one-to-one (`models/hf/hubert.py`)
and which is the parity oracle (tests/test_hubert.py). HF has no pre-training head: a HF
export holds the body only. The loss on these outputs (masked prediction of cluster targets)
is in `objectives/hubert.py`. `HubertForCTC` is the body fine-tuned for speech recognition
(HF `HubertForCTC`, fairseq `HubertCtc`): wav2vec 2.0's CTC network on HuBERT's body.

Paper sections: §II-A/B (learning the hidden units, masked prediction), §II-E (the model: the same
feature encoder and Transformer as wav2vec 2.0, the projection matrix A and the embeddings
e_c of codewords, p_f(c | X~, t) proportional to exp(sim(A o_t, e_c) / tau), tau = 0.1).
Shape comments use the letters of `models.wav2vec2.Wav2Vec2`'s legend, K the clusters and E
`final_dim`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.models.layers import dense, split_rng
from pretext_jax.models.wav2vec2 import (
    SpeechEncoderConfig,
    Wav2Vec2Body,
    Wav2Vec2CTCConfig,
    Wav2Vec2ForCTC,
)


@dataclasses.dataclass(frozen=True)
class HubertConfig(SpeechEncoderConfig):
    """The HuBERT network: the shared encoder (`SpeechEncoderConfig`, defaults fairseq
    `hubert_base_librispeech`'s, which are wav2vec 2.0 BASE's) and the pre-training head (HF
    `HubertConfig` names in brackets)."""

    feature_projection_layer_norm: bool = True
    """LayerNorm on the feature encoder's output before the projection (fairseq HuBERT: always;
    HF `feat_proj_layer_norm`, False in DistilHuBERT-style checkpoints)."""
    num_classes: int = 100
    """K, clusters of the targets (paper: 100 for iteration 1 on MFCCs, 500 after); a run sets
    it from objective.num_clusters."""
    final_dim: int = 256
    """E, width of the space where projected frames meet the cluster embeddings (fairseq
    `final_dim` 256)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_classes", "final_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")

    @property
    def normalizes_features(self) -> bool:
        return self.feature_projection_layer_norm


def cosine_similarities(x: jax.Array, embeddings: jax.Array) -> jax.Array:
    """[..., E] x [K, E] -> [..., K] float32 cosine similarities, x . e / max(|x| |e|, 1e-8)
    (torch `cosine_similarity`'s eps, as fairseq's `compute_nce` computes them)."""
    x, e = x.astype(jnp.float32), embeddings.astype(jnp.float32)
    norms = jnp.sqrt(jnp.sum(x * x, -1))[..., None] * jnp.sqrt(jnp.sum(e * e, -1))
    return jnp.einsum("...e,ke->...k", x, e) / jnp.maximum(norms, 1e-8)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HubertOutput:
    """What the pre-training loss reads:

    - `last_hidden_state` [B, T, H]: the context network's output o_t.
    - `projected_states` [B, T, E]: `final_proj`(o_t), A o_t of §II-E.
    - `conv_features` [B, T, C]: the feature encoder's output before its LayerNorm (after the
      gradient scaling), whose mean square is fairseq's `features_pen`.
    - `frames` [B, T]: True at real (not padding) frames.
    """

    last_hidden_state: jax.Array
    projected_states: jax.Array
    conv_features: jax.Array
    frames: jax.Array


class Hubert(Wav2Vec2Body):
    """HuBERT for pre-training: waveform -> conv features -> LayerNorm -> projection, dropout,
    masked frames replaced by `masked_spec_embed` (fairseq `mask_emb`) -> context network ->
    `final_proj`; `label_embeddings` [K, E] are the codeword embeddings e_c."""

    def __init__(self, config: HubertConfig, *, rngs: nnx.Rngs):
        super().__init__(config, rngs=rngs)
        with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
            self.final_proj = dense(config, config.hidden_size, config.final_dim,
                                    ("embed", None), rngs)
            # fairseq: nn.init.uniform_(label_embs_concat), U(0, 1)
            self.label_embeddings = nnx.Param(
                jax.random.uniform(rngs.params(), (config.num_classes, config.final_dim)),
                out_sharding=(None, None))

    def __call__(
        self,
        input_values: jax.Array,
        attention_mask: jax.Array | None = None,
        mask_time_indices: jax.Array | None = None,
        rng: jax.Array | None = None,
        *,
        feature_gradient_scale: float = 1.0,
        groups: int = 1,
    ) -> HubertOutput:
        """`input_values` [B, S] waveforms (right-padded), `attention_mask` [B, S] (1 = real
        sample; None = all real), `mask_time_indices` [B, T] (True = frame masked; None =
        none); `rng` None = evaluation (no dropout or LayerDrop). `feature_gradient_scale` and
        `groups` as `Wav2Vec2.__call__`'s (fairseq `feature_grad_mult`; LayerDrop draws per
        group of rows)."""
        projection_rng, encoder_rng = split_rng(rng, 2)
        features, frames, _, hidden = self._encoder_inputs(
            input_values, attention_mask, projection_rng, feature_gradient_scale)
        if mask_time_indices is not None:
            hidden = self.mask_frames(hidden, mask_time_indices)
        last_hidden_state = self.encoder(hidden, frames, encoder_rng,
                                         groups=groups)[0]  # [B, T, H]
        return HubertOutput(last_hidden_state=last_hidden_state,
                            projected_states=self.final_proj(last_hidden_state),  # [B, T, E]
                            conv_features=features, frames=frames)

    def cluster_similarity(self, projected_states: jax.Array) -> jax.Array:
        """sim(A o_t, e_c) of §II-E for every cluster: `cosine_similarities` of
        `projected_states` [B, T, E] with `label_embeddings` -> [B, T, K]."""
        return cosine_similarities(projected_states, self.label_embeddings[...])


@dataclasses.dataclass(frozen=True)
class HubertCTCConfig(Wav2Vec2CTCConfig):
    """HuBERT fine-tuned for speech recognition (HF `HubertForCTC`): `Wav2Vec2CTCConfig` (the
    network, `vocab_size`, `blank_id`, `final_dropout`; its quantiser fields build nothing) with
    HuBERT's `feature_projection_layer_norm`."""

    feature_projection_layer_norm: bool = True
    """LayerNorm on the feature encoder's output before the projection (as `HubertConfig`'s;
    HF `feat_proj_layer_norm`)."""

    @property
    def normalizes_features(self) -> bool:
        return self.feature_projection_layer_norm


class HubertForCTC(Wav2Vec2ForCTC):
    """HuBERT's body, dropout and a linear layer to the vocabulary (HF `HubertForCTC`, fairseq
    `HubertCtc` of hubert_asr.py): the same network and call as `Wav2Vec2ForCTC` (HF's two
    classes are the same modules), its own class so that it converts to and from
    `HubertForCTC` (`models/hf/hubert.py`); built from a `HubertCTCConfig`."""
