"""Context prediction's patch pairs (Doersch et al. 2015 "Unsupervised Visual Representation
Learning by Context Prediction", §3 and §3.1; cdoersch/deepcontext train.py).

- `pair_positions`: a 3x3 grid of `patch`-pixel cells `gap` pixels apart (train.py:14-17:
  96 and 48) at a uniform place in the image; the first patch is the centre cell, the second
  one of its 8 neighbours, uniformly; each patch moved by its own jitter, uniform in
  [-jitter, jitter] per axis (train.py:121-131: up to 7 pixels). The whole jittered grid fits,
  so where the pair lies says nothing of its label. Labels are the second patch's place
  relative to the first, row-major over the 8 neighbours (train.py:236-249 `pos2lbl`).
- `degrade`: with a probability (train.py:92: 0.33), the patch resized down to a side whose
  area is uniform between `min_pixels` and (patch - 1)^2 (train.py:94: 100 and 95^2) and back
  (bilinear, half-pixel centres, edges clamped), against pixelation shortcuts (§3.1).
- `counter_aberration`: the remedies against chromatic aberration (§3.1). `drop`: one channel
  kept, uniformly, its mean subtracted; the two others replaced by uniform noise of +-0.5 grey
  levels (train.py:98-105; the paper's Gaussian noise of ~1/100 the kept channel's deviation).
  `project`: every pixel's colour (channel means subtracted) times B = I - a a^T / (a^T a),
  a = (-1, 2, -1), which removes the green-magenta component (§3.1). `none`: means subtracted.
- Every patch is then scaled to unit root mean square (train.py:107-110 scales to 50, the
  variance of AlexNet's usual inputs; our first layer is followed by BatchNorm).

All of it runs on device inside the jitted step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

GRID = 3
# The second patch's (row, column) offset from the first, in label order (train.py:236-249).
NEIGHBOURS = np.array([(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1) if dy or dx])
CLASSES = len(NEIGHBOURS)
GREEN_MAGENTA = np.array([-1.0, 2.0, -1.0])
PROJECTION = np.eye(3) - np.outer(GREEN_MAGENTA, GREEN_MAGENTA) / (GREEN_MAGENTA @ GREEN_MAGENTA)
COUNTER_MEASURES = ("drop", "project", "none")
NOISE_HALF_WIDTH = 0.5 / 255  # train.py:105: uniform(0, 1) - 0.5 on the 0..255 scale


def grid_size(patch: int, gap: int, jitter: int) -> int:
    """Side of the window the jittered 3x3 grid needs."""
    return GRID * patch + (GRID - 1) * gap + 2 * jitter


def pair_positions(rng: jax.Array, height: int, width: int, patch: int, gap: int,
                   jitter: int) -> tuple[jax.Array, jax.Array]:
    """The pair's (top, left) corners [2, 2] (centre first) and its label [] (module
    docstring)."""
    window = grid_size(patch, gap, jitter)
    if height < window or width < window:
        raise ValueError(f"images of {height}x{width} are smaller than the grid ({window})")
    origin_key, label_key, jitter_key = jax.random.split(rng, 3)
    origin = jax.random.randint(origin_key, (2,), 0,
                                jnp.array([height - window + 1, width - window + 1]))
    label = jax.random.randint(label_key, (), 0, CLASSES)
    cells = jnp.stack([jnp.ones(2, jnp.int32), 1 + jnp.asarray(NEIGHBOURS)[label]])
    offsets = jax.random.randint(jitter_key, (2, 2), -jitter, jitter + 1)
    return origin + jitter + cells * (patch + gap) + offsets, label


def resize_matrix(size: jax.Array, source: jax.Array, buffer: int) -> jax.Array:
    """[buffer, buffer] bilinear interpolation from the first `source` to the first `size`
    entries of a `buffer`-long axis (half-pixel centres, edges clamped); other rows are 0."""
    rows = jnp.arange(buffer)
    where = jnp.clip((rows + 0.5) * source / size - 0.5, 0.0, source - 1.0)
    low = jnp.floor(where).astype(jnp.int32)
    high = jnp.minimum(low + 1, source - 1)
    weight = (where - low)[:, None]
    matrix = (1 - weight) * jax.nn.one_hot(low, buffer) + weight * jax.nn.one_hot(high, buffer)
    return jnp.where((rows < size)[:, None], matrix, 0.0)


def degrade(rng: jax.Array, patch: jax.Array, probability: float, min_pixels: int
            ) -> jax.Array:
    """The [P, P, C] patch, with `probability` downsampled to an area uniform in
    [min_pixels, (P - 1)^2] and back to P (train.py:92-96)."""
    if probability == 0.0:
        return patch
    size = patch.shape[0]
    apply_key, area_key = jax.random.split(rng)
    area = jax.random.uniform(area_key, minval=min_pixels, maxval=(size - 1) ** 2)
    side = jnp.floor(jnp.sqrt(area)).astype(jnp.int32)
    down, up = resize_matrix(side, size, size), resize_matrix(size, side, size)
    resized = jnp.einsum("ij,jkc,lk->ilc", up @ down, patch, up @ down)
    return jnp.where(jax.random.bernoulli(apply_key, probability), resized, patch)


def counter_aberration(rng: jax.Array, patch: jax.Array, mode: str) -> jax.Array:
    """The [P, P, 3] patch after the remedy `mode` against chromatic aberration (module
    docstring), before the scaling to unit root mean square."""
    centred = patch - patch.mean(axis=(0, 1))
    if mode == "project":
        return centred @ jnp.asarray(PROJECTION, patch.dtype)
    if mode == "drop":
        keep_key, noise_key = jax.random.split(rng)
        keep = jax.random.randint(keep_key, (), 0, 3)
        noise = jax.random.uniform(noise_key, patch.shape, minval=-NOISE_HALF_WIDTH,
                                   maxval=NOISE_HALF_WIDTH)
        return jnp.where(jnp.arange(3) == keep, centred, noise)
    if mode == "none":
        return centred
    raise ValueError(f"counter-measure {mode!r} is not one of {COUNTER_MEASURES}")


def unit_rms(patch: jax.Array, epsilon: float = 1e-5) -> jax.Array:
    """The patch divided by its root mean square over pixels and channels (train.py:110)."""
    return patch / (jnp.sqrt(jnp.mean(jnp.square(patch))) + epsilon)


def patch_pair(rng: jax.Array, image: jax.Array, patch: int, gap: int, jitter: int,
               counter_measure: str, downsample_probability: float, min_pixels: int
               ) -> tuple[jax.Array, jax.Array]:
    """The pair [2, patch, patch, 3] of a [H, W, 3] float image, each patch degraded, its
    colour remedied and scaled on its own, and the pair's label [] (module docstring)."""
    position_key, degrade_key, colour_key = jax.random.split(rng, 3)
    positions, label = pair_positions(position_key, *image.shape[:2], patch, gap, jitter)
    patches = jax.vmap(lambda p: jax.lax.dynamic_slice(image, (p[0], p[1], 0),
                                                       (patch, patch, 3)))(positions)
    patches = jax.vmap(lambda k, x: degrade(k, x, downsample_probability, min_pixels))(
        jax.random.split(degrade_key, 2), patches)
    patches = jax.vmap(lambda k, x: unit_rms(counter_aberration(k, x, counter_measure)))(
        jax.random.split(colour_key, 2), patches)
    return patches, label
