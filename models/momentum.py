"""Networks with a momentum (EMA) target: MoCo v2 and BYOL.

Both train an online encoder (ResNet + MLP head) by gradients and keep a target encoder of the
same shape whose parameters are an exponential moving average of the online ones:

- MoCo v2 (He et al. 2020 §3.2; Chen et al. 2020 "Improved Baselines"; facebookresearch/moco
  moco/builder.py): query encoder = ResNet + MLP head (dense with bias, ReLU, dense with bias;
  hidden = the backbone's width, 2048 for ResNet-50; 128 out, no BatchNorm); key encoder = its
  momentum copy, initialised equal; a queue of K L2-normalised keys with a FIFO pointer,
  initialised as normalised Gaussian noise as builder.py does.
- BYOL (Grill et al. 2020 §3.1, Appendix J; deepmind byol utils/networks.py `MLP`,
  byol_experiment.py): online = ResNet + projector (dense with bias, BatchNorm, ReLU, dense
  without bias; 4096 hidden, 256 out) + predictor of the same shape; target = EMA of the online
  ResNet + projector, initialised independently (byol_experiment.py `_make_initial_state`
  draws it with its own rng).

Target parameters are `EMA` Variables, not `nnx.Param`: the optimizer never sees them, and the
trainer carries them from step to step and checkpoints them as model state, like the queue,
BYOL's update counter and every BatchNorm statistic. Only parameters are averaged; the
target's BatchNorm statistics are its own, updated by its forward passes in training mode
(both references run the target in training mode).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.models.layers import UpdateCount, params_as
from pretext_jax.models.resnet import ResNet, ResNetConfig
from pretext_jax.models.simclr import SimCLROutput


class EMA(nnx.Variable):
    """A target-network parameter: the moving average of its online counterpart."""


class Queue(nnx.Variable):
    """MoCo's queue of keys and its write pointer."""


@dataclasses.dataclass(frozen=True)
class MoCoConfig(ResNetConfig):
    """`projection_hidden_dim` 0 = the backbone's width (builder.py `dim_mlp`), `projection_dim`
    the key size (128), `queue_size` K (65536)."""

    projection_hidden_dim: int = 0
    """Hidden width of the MLP head; 0 = the backbone's feature width (MoCo v2: 2048)."""
    projection_dim: int = 128
    """Size of queries and keys: the MLP head's output (MoCo 128)."""
    queue_size: int = 65536
    """Keys in the queue of negatives, K (MoCo 65536); at least the (micro-)batch."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.projection_hidden_dim < 0 or self.projection_dim < 1 or self.queue_size < 1:
            raise ValueError("projection_hidden_dim must be >= 0, projection_dim and queue_size "
                             ">= 1")


@dataclasses.dataclass(frozen=True)
class BYOLConfig(ResNetConfig):
    """Projector and predictor MLPs: `projection_hidden_dim` 4096 -> `projection_dim` 256,
    predictor `predictor_hidden_dim` 4096 -> 256 (Grill et al. 2020 §3.3)."""

    projection_hidden_dim: int = 4096
    """Hidden width of the projector MLP (BYOL 4096)."""
    projection_dim: int = 256
    """Output width of the projector and the predictor (BYOL 256)."""
    predictor_hidden_dim: int = 4096
    """Hidden width of the predictor MLP (BYOL 4096)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if min(self.projection_hidden_dim, self.projection_dim, self.predictor_hidden_dim) < 1:
            raise ValueError("projection_hidden_dim, projection_dim and predictor_hidden_dim "
                             "must be >= 1")


class MLP(nnx.Module):
    """dense (bias) -> [BatchNorm] -> ReLU -> dense (bias optional)."""

    def __init__(self, config: ResNetConfig, in_features: int, hidden: int, out: int, *,
                 batch_norm: bool, output_bias: bool, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        self.hidden = nnx.Linear(in_features, hidden, dtype=dtype, rngs=rngs)
        self.normalization = (nnx.BatchNorm(hidden, momentum=config.batch_norm_momentum,
                                            epsilon=config.batch_norm_epsilon, dtype=dtype,
                                            rngs=rngs) if batch_norm else None)
        self.output = nnx.Linear(hidden, out, use_bias=output_bias, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = self.hidden(x)
        if self.normalization is not None:
            x = self.normalization(x, use_running_average=not train)
        return self.output(jax.nn.relu(x))


class Encoder(nnx.Module):
    """ResNet backbone + MLP head: features h and projections z (`SimCLROutput`)."""

    def __init__(self, config: ResNetConfig, hidden: int, out: int, *, batch_norm: bool,
                 output_bias: bool, rngs: nnx.Rngs):
        self.backbone = ResNet(config.backbone_config(), rngs=rngs)
        width = self.backbone.config.features
        self.head = MLP(config, width, hidden or width, out, batch_norm=batch_norm,
                        output_bias=output_bias, rngs=rngs)

    def __call__(self, images: jax.Array, *, train: bool) -> SimCLROutput:
        features = self.backbone(images, train=train)
        return SimCLROutput(features=features, projections=self.head(features, train))


def momentum_copy(module: nnx.Module) -> nnx.Module:
    """An independent copy of `module` whose parameters are `EMA` Variables (same values and
    sharding metadata); its other state (BatchNorm statistics) is copied as it is."""
    return params_as(module, EMA)


def ema_update(target: nnx.Module, online: nnx.Module, decay: jax.Array | float) -> None:
    """target <- decay * target + (1 - decay) * online for every parameter (paths pair up, as
    `momentum_copy` made them); the online values pass through stop_gradient, so the update
    is no path for gradients (builder.py `_momentum_update_key_encoder`,
    byol_experiment.py `_update_fn`)."""
    online_params = dict(nnx.to_flat_state(nnx.state(online, nnx.Param)))
    for path, variable in nnx.to_flat_state(nnx.state(target, EMA)):
        value = jax.lax.stop_gradient(online_params[path].get_value())
        variable.set_value(decay * variable.get_value() + (1.0 - decay) * value)


def call_in_groups(module: nnx.Module, images: jax.Array, groups: int) -> SimCLROutput:
    """`module(images, train=True)` with BatchNorm statistics computed separately over each of
    `groups` consecutive slices of the batch, as on `groups` GPUs without synchronised
    BatchNorm (MoCo §3.3). The running statistics advance by the mean of the groups' updates.
    `groups=1` is BatchNorm over the whole (global) batch."""
    if groups == 1:
        return module(images, train=True)
    graphdef, state = nnx.split(module)

    def one_group(state: nnx.State, group: jax.Array) -> tuple[SimCLROutput, nnx.State]:
        inner = nnx.merge(graphdef, state)
        return inner(group, train=True), nnx.state(inner, nnx.BatchStat)

    grouped = images.reshape(groups, images.shape[0] // groups, *images.shape[1:])
    outputs, statistics = jax.vmap(one_group, in_axes=(None, 0))(state, grouped)
    nnx.update(module, jax.tree.map(lambda s: s.mean(0), statistics))
    return jax.tree.map(lambda x: x.reshape(images.shape[0], *x.shape[2:]), outputs)


class MoCo(nnx.Module):
    """Query encoder (`online`), key encoder (`target`), queue [K, projection_dim] and its
    pointer."""

    def __init__(self, config: MoCoConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.online = Encoder(config, config.projection_hidden_dim, config.projection_dim,
                              batch_norm=False, output_bias=True, rngs=rngs)
        self.target = momentum_copy(self.online)
        noise = jax.random.normal(rngs.params(), (config.queue_size, config.projection_dim))
        self.queue = Queue(noise / jnp.linalg.norm(noise, axis=1, keepdims=True))
        self.queue_pointer = Queue(jnp.zeros((), jnp.int32))

    @property
    def backbone(self) -> ResNet:
        return self.online.backbone

    def enqueue(self, keys: jax.Array) -> None:
        """Writes `keys` [N, D] over the N oldest entries (FIFO; indices wrap around modulo K,
        builder.py `_dequeue_and_enqueue`, which asserts K % N == 0) and advances the
        pointer."""
        pointer = self.queue_pointer.get_value()
        index = (pointer + jnp.arange(keys.shape[0])) % self.config.queue_size
        self.queue.set_value(self.queue.get_value().at[index].set(
            jax.lax.stop_gradient(keys).astype(self.queue.get_value().dtype)))
        self.queue_pointer.set_value((pointer + keys.shape[0]) % self.config.queue_size)

    def downstream_model(self) -> ResNet:
        """The query encoder's backbone: what linear evaluation and fine-tuning use."""
        return self.online.backbone


class BYOL(nnx.Module):
    """Online encoder + predictor, target encoder (EMA), and the count of target updates."""

    def __init__(self, config: BYOLConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.online = Encoder(config, config.projection_hidden_dim, config.projection_dim,
                              batch_norm=True, output_bias=False, rngs=rngs)
        self.predictor = MLP(config, config.projection_dim, config.predictor_hidden_dim,
                             config.projection_dim, batch_norm=True, output_bias=False,
                             rngs=rngs)
        self.target = momentum_copy(Encoder(
            config, config.projection_hidden_dim, config.projection_dim, batch_norm=True,
            output_bias=False, rngs=rngs))
        self.target_updates = UpdateCount(jnp.zeros((), jnp.int32))

    @property
    def backbone(self) -> ResNet:
        return self.online.backbone

    def downstream_model(self) -> ResNet:
        """The online backbone: what linear evaluation and fine-tuning use."""
        return self.online.backbone
