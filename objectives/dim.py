"""Deep InfoMax (Hjelm et al. 2019 "Learning deep representations by mutual information
estimation and maximization", §3 and Appendix A.2; rdevon/DIM cortex_DIM/functions/
dim_losses.py `fenchel_dual_loss`, gan_losses.py, models/dim.py).

The encoder gives a local map M (h x w locations) and a global vector Y of every image
(`models.infomax.DIM`). Local DIM ("encode-and-dot-product", Appendix A.2): M's locations and Y
are embedded to a shared width and every (image i's Y, image j's location l) pair in the batch
gets the score T[i, j, l] = embedding(Y_i) . embedding(M_j)[l]. Positives are an image's own
locations (i = j), negatives every other image's; the Jensen-Shannon estimator (eq. 4)

    I_JSD = E_P[-softplus(-T)] - E_N[softplus(T)]

is maximised (the loss is its negative; `fenchel_dual_loss` with measure JSD shifts both means
by log 2, a constant). Global DIM scores Y against one embedding of the whole map the same
way (one "location"). The loss is beta x local + alpha x global (eq. 8 without the
prior-matching term gamma, which is not implemented). The paper augments only STL-10 (random
crops and flips), not CIFAR: each image is seen as it is, at `image_size`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.models.infomax import DIM, DIMConfig
from pretext_jax.objectives.common.preset_parts import TINY_IMAGE_TRAIN
from pretext_jax.objectives.common.two_view import (
    ImageExampleConfig,
    check_host_crops,
    evaluation_view,
    knn_monitor,
    knn_summary,
    prepare_two_view_images,
    single_view,
)
from pretext_jax.objectives.registry import Batch, Evaluation, Method, Metrics, Resolution, register


@dataclasses.dataclass(frozen=True)
class DIMSettings:
    """The `objective` section: the images' side and the weights of eq. 8 (DIM(L) of Table 1:
    alpha 0, beta 1; the prior term gamma is not implemented)."""

    image_size: int = 32
    """Side of the images the encoder sees, and the kNN monitor's (CIFAR 32)."""
    global_weight: float = 0.0
    """alpha: weight of global DIM, >= 0 (DIM(L) 0, DIM(G) 1)."""
    local_weight: float = 1.0
    """beta: weight of local DIM, >= 0 (DIM(L) 1, DIM(G) 0)."""

    def __post_init__(self) -> None:
        if self.image_size < 1 or min(self.global_weight, self.local_weight) < 0:
            raise ValueError("image_size must be >= 1 and the weights >= 0")
        if self.global_weight == self.local_weight == 0:
            raise ValueError("global_weight and local_weight are both 0: nothing to train")


def jsd_mi_loss(vectors: jax.Array, locations: jax.Array) -> tuple[jax.Array, jax.Array]:
    """-I_JSD of the scores T[i, j, l] = vectors[i] . locations[j, l] (`vectors` [N, D],
    `locations` [N, L, D]): positives i = j, negatives i != j, each mean over its pairs and
    all L locations. Returns (loss, I_JSD)."""
    scores = jnp.einsum("id,jld->ijl", vectors.astype(jnp.float32),
                        locations.astype(jnp.float32))
    count = scores.shape[0]
    same = jnp.eye(count, dtype=bool)[:, :, None]
    positive = jnp.sum(jnp.where(same, -jax.nn.softplus(-scores), 0.0))
    negative = jnp.sum(jnp.where(same, 0.0, jax.nn.softplus(scores)))
    locations_count = scores.shape[2]
    estimate = (positive / (count * locations_count)
                - negative / (max(count * (count - 1), 1) * locations_count))
    return -estimate, estimate


def dim_loss(model: DIM, batch: Batch, rng: jax.Array | None, *,
             objective: DIMSettings | None = None) -> tuple[jax.Array, Metrics]:
    """beta x local DIM + alpha x global DIM (module docstring); `rng` None (evaluation):
    BatchNorm running statistics."""
    objective = objective or DIMSettings()
    images = evaluation_view(single_view(batch["image"]), objective.image_size)
    output = model(images, train=rng is not None, global_dim=objective.global_weight > 0)
    one = jnp.ones((), jnp.float32)
    local_loss, local_mi = jsd_mi_loss(
        output.global_, output.local.reshape(output.local.shape[0], -1, output.local.shape[-1]))
    loss = objective.local_weight * local_loss
    metrics = {"local_jsd": (local_mi, one)}
    if objective.global_weight > 0:
        global_loss, global_mi = jsd_mi_loss(output.global_vector, output.global_map[:, None])
        loss = loss + objective.global_weight * global_loss
        metrics["global_jsd"] = (global_mi, one)
    return loss, {"loss": (loss, one), **metrics}


def check_dim(model: DIMConfig, examples: ImageExampleConfig, objective: DIMSettings) -> None:
    """`check_host_crops`, and global DIM's networks where its term is weighted."""
    check_host_crops(model, examples, objective)
    if objective.global_weight > 0 and not model.global_mi:
        raise UserError(f"objective.global_weight={objective.global_weight} needs global DIM's "
                        "networks; set model.global_mi=true (or objective.global_weight=0)")


def build_dim(config: DIMConfig, seed: int) -> DIM:
    with nnx.use_eager_sharding(False):
        return DIM(config, rngs=nnx.Rngs(seed))


# Adam at a constant lr (cortex_DIM models/dim.py defaults: lr 1e-4, batch 64, 1000 epochs;
# torch's Adam: bias-corrected, eps 1e-8), no weight decay, schedule or clipping.
_ADAM = {"optimizer": "adamw", "schedule": "constant", "warmup_steps": 0, "weight_decay": 0.0,
         "bias_correction": True, "eps": 1e-8, "clip_norm": 0.0}

PRESETS = {
    # The CIFAR recipe at test size: a narrow ResNet-18, small embeddings, local and global
    # DIM both on (alpha 0.5, beta 1) so that both paths train; a 10x larger lr for 200 steps.
    "dim_tiny": {
        "model": {"depth": 18, "stem": "cifar", "base_width": 8, "local_stage": 3,
                  "hidden_dim": 64, "global_dim": 16, "mi_units": 64, "global_mi": True},
        "objective": {"image_size": 32, "global_weight": 0.5, "local_weight": 1.0},
        "optim": {**_ADAM, "learning_rate": 1e-3},
        "train": TINY_IMAGE_TRAIN,
    },
    # DIM(L) on CIFAR-10 (Table 1; cortex_DIM models/dim.py `LocalDIM` defaults): batch 64
    # (skip_last_batch: 781 steps an epoch), 1000 epochs, Adam lr 1e-4; Y of 64 after an fc of
    # 1024 (configs/convnets.py `_basic32x32`), mi_units 2048; alpha 0, beta 1 (gamma 0.1 in
    # the paper: prior matching not implemented). Our ResNet-18 with the CIFAR stem replaces
    # the paper's 3-layer convnet; its stage 3 gives the paper's 8x8 local map.
    "dim_cifar10": {
        "model": {"depth": 18, "stem": "cifar", "local_stage": 3, "hidden_dim": 1024,
                  "global_dim": 64, "mi_units": 2048, "global_mi": False},
        "objective": {"image_size": 32, "global_weight": 0.0, "local_weight": 1.0},
        "data": {"source": ""},
        "optim": {**_ADAM, "learning_rate": 1e-4},
        "train": {"steps": 781000, "batch_size": 64, "eval_every": 7810},
    },
}


register(Method(
    name="dim",
    model_config=DIMConfig,
    example_config=ImageExampleConfig,
    objective_config=DIMSettings,
    build_model=build_dim,
    loss=dim_loss,
    prepare=prepare_two_view_images,
    units_per_example=lambda examples: 1,
    unit="images",
    description="Deep InfoMax: JSD between local features and the global vector "
                "(Hjelm et al. 2019)",
    presets=PRESETS,
    resolution=Resolution(check=check_dim),
    evaluation=Evaluation(monitor=knn_monitor,
                          summarize=knn_summary(("loss", "local_jsd", "global_jsd"))),
))
