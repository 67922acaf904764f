"""ELMo's bidirectional language model (Peters et al. 2018 §3; the network of allenai/bilm-tf
bilm/training.py `LanguageModel`, with Józefowicz et al. 2016's character CNN) and its
task-specific scalar mix (§3.2; bilm-tf bilm/elmo.py `weight_layers`, allennlp
modules/scalar_mix.py).

- Token encoder, shared by both directions: 16-dim character embeddings (uniform(-1, 1)
  init), one convolution per (width, filters) pair of `char_filters` over the token's
  characters (VALID, bias), max over positions, then `char_activation` (relu for ELMo, the
  Kim et al. 2015 uniform(+-0.05) init); `highway_layers` highway layers on the concatenated
  filters (carry gate c = sigmoid(x Wc + bc), bc init -2, y = c relu(x Wt + bt) + (1 - c) x);
  a linear projection to `projection_dim`.
- Per direction, `num_layers` LSTM layers with a projection (TF `LSTMCell(num_proj,
  cell_clip, proj_clip)`: gates i, j, f, o of [x, h] W + b, c = sigmoid(f + 1) c' + sigmoid(i)
  tanh(j) clipped to +-cell_clip, h = (sigmoid(o) tanh(c)) P clipped to +-proj_clip; no
  peepholes), dropout on each layer's input, and from the second layer on a residual connection
  (the layer's dropped input added to its output). The backward direction reads the window
  right to left; padding keeps the state unchanged, so a padded tail is no input to either.
  Each layer of each direction starts from a given (h, c) state (zeros unless one is handed in)
  and gives back its state after the window: bilm-tf's `init_lstm_state` / `final_lstm_state`,
  through which its training carries the states from one batch to the next.
- The softmax (`softmax_kernel` [vocab, projection_dim], `softmax_bias`) is one set of weights
  for both directions, on the top layer's output after dropout.
- The representations for downstream use: layer 0 the token encoder's output duplicated for both
  directions, layer j the forward and backward layer-j outputs concatenated, [L + 1, B, T, 2P].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.models.layers import check_dtype, check_rates, dropout, split_rng


@dataclasses.dataclass(frozen=True)
class ElmoConfig:
    """The biLM's sizes (defaults: bilm-tf's bin/train_elmo.py, the original ELMo)."""

    vocab_size: int = 0
    """Softmax rows, the word vocabulary; 0 = the data's, set when pre-training."""
    char_vocab_size: int = 262
    """Character ids (256 bytes, 5 specials, 0 = no token: allennlp's 262)."""
    char_embedding_dim: int = 16
    """Width of the character embeddings (ELMo 16)."""
    char_filters: str = "1:32,2:32,3:64,4:128,5:256,6:512,7:1024"
    """Convolutions as width:filters, comma-separated (ELMo's seven, 2,048 filters)."""
    char_activation: str = "relu"
    """After max-pooling the convolutions: relu (ELMo) or tanh."""
    highway_layers: int = 2
    """Highway layers on the character features (ELMo 2)."""
    lstm_dim: int = 4096
    """LSTM cells per layer and direction (ELMo 4096)."""
    projection_dim: int = 512
    """Width of the LSTM projection, the token encoder's output and the softmax (ELMo 512)."""
    num_layers: int = 2
    """LSTM layers per direction (ELMo 2)."""
    cell_clip: float = 3.0
    """The LSTM cell state is clipped to +- this (ELMo 3; 0 = no clipping)."""
    proj_clip: float = 3.0
    """The projected LSTM output is clipped to +- this (ELMo 3; 0 = no clipping)."""
    residual: bool = True
    """Residual connection around every LSTM layer but the first (ELMo: use_skip_connections)."""
    dropout: float = 0.1
    """Dropout on every LSTM layer's input and on the top output (ELMo 0.1)."""
    dtype: str = "float32"
    """Compute dtype: float32, bfloat16 or float16 (parameters stay float32)."""
    carried_state_rows: int = 0
    """Rows of the LSTM states the LM keeps between training steps (its `carried_h`,
    `carried_c`); 0 = none. Set from the data when pre-training reads stateful streams."""

    def __post_init__(self) -> None:
        check_dtype(self)
        check_rates(self, ("dropout",))
        for name in ("char_embedding_dim", "lstm_dim", "projection_dim", "num_layers",
                     "char_vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.carried_state_rows < 0:
            raise ValueError(f"carried_state_rows={self.carried_state_rows} must be >= 0")
        if self.highway_layers < 0 or self.cell_clip < 0 or self.proj_clip < 0:
            raise ValueError("highway_layers, cell_clip and proj_clip must be >= 0")
        if self.char_activation not in ("relu", "tanh"):
            raise ValueError(f"char_activation={self.char_activation!r} must be relu or tanh")
        try:
            filters = self.filters
        except ValueError:
            filters = ()
        if not filters or any(w < 1 or n < 1 for w, n in filters):
            raise ValueError(f"char_filters={self.char_filters!r} must be width:filters pairs, "
                             "e.g. 1:32,2:32,3:64")

    @property
    def filters(self) -> tuple[tuple[int, int], ...]:
        """(width, filters) per convolution."""
        return tuple(tuple(int(v) for v in part.split(":")) for part in
                     self.char_filters.split(","))  # type: ignore[misc]

    @property
    def num_filters(self) -> int:
        return sum(n for _, n in self.filters)

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)


def _param(rngs: nnx.Rngs, init: nnx.Initializer, shape: tuple[int, ...],
           axes: tuple[str | None, ...]) -> nnx.Param:
    with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
        return nnx.Param(init(rngs.params(), shape, jnp.float32), out_sharding=axes)


def _uniform(bound: float) -> nnx.Initializer:
    """uniform(-bound, bound), as TF's `random_uniform_initializer(-bound, bound)`."""
    return lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)


def clip(x: jax.Array, bound: float) -> jax.Array:
    return x if bound <= 0 else jnp.clip(x, -bound, bound)


def highway(x: jax.Array, w_carry: jax.Array, b_carry: jax.Array, w_transform: jax.Array,
            b_transform: jax.Array) -> jax.Array:
    """bilm-tf's highway layer: c = sigmoid(x Wc + bc); c relu(x Wt + bt) + (1 - c) x."""
    carry = jax.nn.sigmoid(x @ w_carry + b_carry)
    return carry * jax.nn.relu(x @ w_transform + b_transform) + (1.0 - carry) * x


def lstm_step(kernel: jax.Array, bias: jax.Array, projection: jax.Array, x: jax.Array,
              h: jax.Array, c: jax.Array, cell_clip: float, proj_clip: float
              ) -> tuple[jax.Array, jax.Array]:
    """One step of TF's `LSTMCell` with a projection and clipping (forget bias 1): (h, c)."""
    gates = jnp.concatenate([x, h], -1) @ kernel + bias
    i, j, f, o = jnp.split(gates, 4, axis=-1)
    c = jax.nn.sigmoid(f + 1.0) * c + jax.nn.sigmoid(i) * jnp.tanh(j)
    c = clip(c, cell_clip)
    h = clip((jax.nn.sigmoid(o) * jnp.tanh(c)) @ projection, proj_clip)
    return h, c


def lstm_layer(kernel: jax.Array, bias: jax.Array, projection: jax.Array, x: jax.Array,
               mask: jax.Array, cell_clip: float, proj_clip: float,
               initial: tuple[jax.Array, jax.Array] | None = None
               ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """An LSTMP layer over x [B, T, D], left to right, from `initial` (h [B, P], c [B, cells];
    None: zeros); where `mask` [B, T] is 0 the state is kept (and the output is the kept h).
    Returns (h [B, T, P], the final (h, c))."""
    batch = x.shape[0]
    if initial is None:
        initial = (jnp.zeros((batch, projection.shape[1]), x.dtype),
                   jnp.zeros((batch, projection.shape[0]), x.dtype))
    initial = tuple(state.astype(x.dtype) for state in initial)

    def step(state, inputs):
        h, c = state
        x_t, m_t = inputs
        new_h, new_c = lstm_step(kernel, bias, projection, x_t, h, c, cell_clip, proj_clip)
        keep = m_t[:, None] > 0
        h, c = jnp.where(keep, new_h, h), jnp.where(keep, new_c, c)
        return (h, c), h

    final, hs = jax.lax.scan(step, initial, (jnp.swapaxes(x, 0, 1), jnp.swapaxes(mask, 0, 1)))
    return jnp.swapaxes(hs, 0, 1), final


class CharCNN(nnx.Module):
    """The token encoder: character embeddings, convolutions with max-pooling, highway layers,
    projection (see the module docstring)."""

    def __init__(self, config: ElmoConfig, *, rngs: nnx.Rngs):
        self.config = config
        d, n, p = config.char_embedding_dim, config.num_filters, config.projection_dim
        self.char_embedding = _param(rngs, _uniform(1.0), (config.char_vocab_size, d),
                                     (None, None))
        # relu: uniform(+-0.05) (Kim et al. 2015); tanh: normal, std sqrt(1 / (width d)).
        self.conv_kernels = nnx.List([
            _param(rngs, _uniform(0.05) if config.char_activation == "relu"
                   else nnx.initializers.normal(1 / np.sqrt(width * d)),
                   (width, d, num), (None, None, "mlp"))
            for width, num in config.filters])
        self.conv_biases = nnx.List([_param(rngs, nnx.initializers.zeros_init(), (num,),
                                            ("mlp",)) for _, num in config.filters])
        layers = config.highway_layers
        self.highway_carry = _param(rngs, nnx.initializers.normal(1 / np.sqrt(n)),
                                    (layers, n, n), ("layers", None, None))
        self.highway_carry_bias = _param(rngs, nnx.initializers.constant(-2.0), (layers, n),
                                         ("layers", None))
        self.highway_transform = _param(rngs, nnx.initializers.normal(1 / np.sqrt(n)),
                                        (layers, n, n), ("layers", None, None))
        self.highway_transform_bias = _param(rngs, nnx.initializers.zeros_init(),
                                             (layers, n), ("layers", None))
        self.projection = _param(rngs, nnx.initializers.normal(1 / np.sqrt(n)), (n, p),
                                 (None, "embed"))
        self.projection_bias = _param(rngs, nnx.initializers.zeros_init(), (p,), ("embed",))

    def __call__(self, chars: jax.Array) -> jax.Array:
        """chars [..., C] int -> token representations [..., projection_dim]."""
        config, dtype = self.config, self.config.compute_dtype
        x = self.char_embedding[...].astype(dtype)[chars.astype(jnp.int32)]  # [..., C, d]
        activation = jax.nn.relu if config.char_activation == "relu" else jnp.tanh
        features = []
        for (width, _), kernel, bias in zip(config.filters, self.conv_kernels, self.conv_biases,
                                             strict=True):
            kernel = kernel[...].astype(dtype)
            span = x.shape[-2] - width + 1
            conv = sum(x[..., k:k + span, :] @ kernel[k] for k in range(width))
            features.append(activation(jnp.max(conv, axis=-2) + bias[...].astype(dtype)))
        h = jnp.concatenate(features, -1)
        for layer in range(config.highway_layers):
            h = highway(h, *(p[...][layer].astype(dtype) for p in (
                self.highway_carry, self.highway_carry_bias, self.highway_transform,
                self.highway_transform_bias)))
        return h @ self.projection[...].astype(dtype) + self.projection_bias[...].astype(dtype)


class BiLM(nnx.Module):
    """Token encoder + forward and backward LSTMP stacks (ELMo's biLM without its softmax)."""

    def __init__(self, config: ElmoConfig, *, rngs: nnx.Rngs):
        self.config = config
        p, cell, layers = config.projection_dim, config.lstm_dim, config.num_layers
        self.token_encoder = CharCNN(config, rngs=rngs)
        # [direction (forward, backward), layer, ...]; glorot uniform as TF's default.
        glorot = nnx.initializers.variance_scaling(1.0, "fan_avg", "uniform", in_axis=-2,
                                                   out_axis=-1, batch_axis=(0, 1))
        self.lstm_kernel = _param(rngs, glorot, (2, layers, 2 * p, 4 * cell),
                                  (None, "layers", "embed", "mlp"))
        self.lstm_bias = _param(rngs, nnx.initializers.zeros_init(), (2, layers, 4 * cell),
                                (None, "layers", "mlp"))
        self.lstm_projection = _param(rngs, glorot, (2, layers, cell, p),
                                      (None, "layers", "mlp", "embed"))

    def __call__(self, chars: jax.Array, mask: jax.Array, rng: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array]:
        """chars [B, T, C], mask [B, T] -> (token representations [B, T, P], LSTM outputs
        [2 (forward, backward), L, B, T, P], before the top output's dropout), both directions
        over the same window from a zero state."""
        tokens = self.token_encoder(chars)
        outputs, _ = self.lstm_stacks(jnp.stack([tokens, tokens]), jnp.stack([mask, mask]), rng)
        return tokens, outputs

    def lstm_stacks(self, tokens: jax.Array, mask: jax.Array, rng: jax.Array | None = None,
                    initial: tuple[jax.Array, jax.Array] | None = None
                    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """The forward stack over tokens[0] [B, T, P] left to right and the backward stack over
        tokens[1] right to left (mask [2, B, T]), each layer from `initial` (h [2, L, B, P],
        c [2, L, B, cells]; None: zeros). Returns (outputs [2, L, B, T, P] in text order, the
        final (h, c) of every layer, as `initial`)."""
        config = self.config

        def direction(kernel, bias, projection, x, m, keys, h0, c0):  # one direction's stack
            layers, final_h, final_c = [], [], []
            for layer in range(config.num_layers):
                inputs = dropout(x, config.dropout, None if keys is None else keys[layer])
                h, (last_h, last_c) = lstm_layer(
                    kernel[layer].astype(x.dtype), bias[layer].astype(x.dtype),
                    projection[layer].astype(x.dtype), inputs, m, config.cell_clip,
                    config.proj_clip, None if h0 is None else (h0[layer], c0[layer]))
                x = h + inputs if config.residual and layer else h
                layers.append(x)
                final_h.append(last_h)
                final_c.append(last_c)
            return jnp.stack(layers), (jnp.stack(final_h), jnp.stack(final_c))

        # Both directions at once; the backward one reads time reversed (padding first).
        keys = None if rng is None else jax.random.split(rng, (2, config.num_layers))
        h0, c0 = (None, None) if initial is None else initial
        outputs, final = jax.vmap(direction, in_axes=(0, 0, 0, 0, 0, None if keys is None else 0,
                                                      0, 0))(
            self.lstm_kernel[...], self.lstm_bias[...], self.lstm_projection[...],
            jnp.stack([tokens[0], tokens[1][:, ::-1]]), jnp.stack([mask[0], mask[1][:, ::-1]]),
            keys, h0, c0)
        return jnp.stack([outputs[0], outputs[1][:, :, ::-1]]), final

    def layer_representations(self, chars: jax.Array, mask: jax.Array,
                              rng: jax.Array | None = None) -> jax.Array:
        """ELMo's L + 1 layers [L + 1, B, T, 2P]: the token representation twice, then each
        LSTM layer's forward and backward outputs side by side."""
        tokens, outputs = self(chars, mask, rng)
        return jnp.concatenate([
            jnp.concatenate([tokens, tokens], -1)[None],
            jnp.concatenate([outputs[0], outputs[1]], -1)], 0)


class CarriedState(nnx.Variable):
    """LSTM states kept from one training step to the next: model state, not a parameter."""


class ElmoLM(nnx.Module):
    """The biLM with its softmax shared by the directions (what pre-training trains). With
    `carried_state_rows` > 0 it holds every layer's final state of both directions,
    `carried_h` [2, L, rows, P] and `carried_c` [2, L, rows, cells] (zeros at first), for the
    training loop to hand back as the next window's initial state."""

    def __init__(self, config: ElmoConfig, *, rngs: nnx.Rngs):
        if config.vocab_size < 1:
            raise ValueError("vocab_size must be set (>= 1) to build the softmax")
        self.config = config
        self.bilm = BiLM(config, rngs=rngs)
        p = config.projection_dim
        self.softmax_kernel = _param(rngs, nnx.initializers.normal(1 / np.sqrt(p)),
                                     (config.vocab_size, p), ("vocab", "embed"))
        self.softmax_bias = _param(rngs, nnx.initializers.zeros_init(), (config.vocab_size,),
                                   ("vocab",))
        if config.carried_state_rows:
            rows, layers = config.carried_state_rows, config.num_layers
            with nnx.use_eager_sharding(False):  # rows split as the batch is (pretrain.mesh)
                self.carried_h = CarriedState(jnp.zeros((2, layers, rows, p), jnp.float32),
                                              out_sharding=(None, None, "batch", None))
                self.carried_c = CarriedState(
                    jnp.zeros((2, layers, rows, config.lstm_dim), jnp.float32),
                    out_sharding=(None, None, "batch", None))

    def __call__(self, chars: jax.Array, mask: jax.Array, rng: jax.Array | None = None, *,
                 backward_chars: jax.Array | None = None, backward_mask: jax.Array | None = None,
                 initial: tuple[jax.Array, jax.Array] | None = None
                 ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """The top forward and backward outputs after dropout, [2, B, T, P] in text order (the
        softmax's inputs), and every layer's final (h, c) (`BiLM.lstm_stacks`). Both directions
        read `chars` [B, T, C] (mask [B, T]), or the backward one `backward_chars` (another
        window, `backward_mask`); from `initial` (h [2, L, B, P], c [2, L, B, cells]; None:
        zeros)."""
        bilm_rng, out_rng = split_rng(rng, 2)
        if backward_chars is None:
            tokens = self.bilm.token_encoder(chars)
            tokens, mask = jnp.stack([tokens, tokens]), jnp.stack([mask, mask])
        else:
            tokens = self.bilm.token_encoder(jnp.stack([chars, backward_chars]))
            mask = jnp.stack([mask, backward_mask])
        outputs, final = self.bilm.lstm_stacks(tokens, mask, bilm_rng, initial)
        return dropout(outputs[:, -1], self.config.dropout, out_rng), final

    def downstream_model(self) -> BiLM:
        """What a downstream task starts from: the biLM without the softmax."""
        return self.bilm


class ScalarMix(nnx.Module):
    """gamma * sum_j softmax(s)_j h_j over the layers (Peters et al. 2018 eq. 1; s = 0 and
    gamma = 1 at the start, as allennlp's `ScalarMix`)."""

    def __init__(self, num_layers: int):
        self.scalars = nnx.Param(jnp.zeros((num_layers,), jnp.float32))
        self.gamma = nnx.Param(jnp.ones((), jnp.float32))

    def __call__(self, layers: jax.Array) -> jax.Array:
        weights = jax.nn.softmax(self.scalars[...]).astype(layers.dtype)
        return self.gamma[...].astype(layers.dtype) * jnp.einsum("l,l...->...", weights, layers)


@dataclasses.dataclass(frozen=True)
class ElmoClassifierConfig(ElmoConfig):
    """The biLM's config plus a sentence(-pair) classification head on its scalar mix."""

    num_labels: int = 2
    """Outputs: classes, or 1 for regression (STS-B)."""
    head_hidden: int = 64
    """Width of the head's hidden layer."""
    head_dropout: float = 0.5
    """Dropout on the ELMo vectors and the head's hidden layer (Peters et al. 2018: 0.5 on ELMo)."""
    freeze_bilm: bool = True
    """Keep the biLM's weights fixed (the paper, §3.3); only the mix and the head train."""
    init: str = ""
    """The pre-trained ELMo: a pretext workdir or model directory; '' = random biLM."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_rates(self, ("head_dropout",))
        if self.num_labels < 1 or self.head_hidden < 1:
            raise ValueError("num_labels and head_hidden must be >= 1")

    def bilm_config(self) -> ElmoConfig:
        """The fields of `ElmoConfig` (what the pre-trained biLM must match)."""
        return ElmoConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(
            ElmoConfig)})


class ElmoClassifier(nnx.Module):
    """ELMo vectors (the scalar mix of the biLM's layers, §3.2) pooled over the tokens (mean and
    max), a ReLU layer and a linear output: logits [B, num_labels]. With `freeze_bilm` the
    biLM's outputs are a constant for the gradient (§3.3: its weights stay fixed)."""

    def __init__(self, config: ElmoClassifierConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.bilm = BiLM(config, rngs=rngs)
        self.scalar_mix = ScalarMix(config.num_layers + 1)
        width = 2 * config.projection_dim
        normal = nnx.initializers.normal(0.02)
        self.hidden = nnx.Linear(2 * width, config.head_hidden, kernel_init=normal, rngs=rngs)
        self.output = nnx.Linear(config.head_hidden, config.num_labels, kernel_init=normal,
                                 rngs=rngs)

    def __call__(self, chars: jax.Array, mask: jax.Array, rng: jax.Array | None = None
                 ) -> jax.Array:
        bilm_rng, mix_rng, hidden_rng = split_rng(rng, 3)
        layers = self.bilm.layer_representations(chars, mask, bilm_rng)
        if self.config.freeze_bilm:
            layers = jax.lax.stop_gradient(layers)
        vectors = dropout(self.scalar_mix(layers), self.config.head_dropout, mix_rng)
        weights = mask[..., None].astype(vectors.dtype)
        mean = jnp.sum(vectors * weights, 1) / jnp.maximum(jnp.sum(weights, 1), 1.0)
        top = jnp.max(jnp.where(weights > 0, vectors, jnp.finfo(vectors.dtype).min), 1)
        hidden = jax.nn.relu(self.hidden(jnp.concatenate([mean, top], -1)))
        return self.output(dropout(hidden, self.config.head_dropout, hidden_rng))
