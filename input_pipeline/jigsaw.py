"""The jigsaw puzzle's data (Noroozi & Favaro 2016 "Unsupervised Learning of Visual
Representations by Solving Jigsaw Puzzles", §3 and §3.2; bbrattoli/JigsawPuzzlePytorch
select_permutations.py and Dataset/JigsawImageLoader.py).

- `permutation_set`: the paper's Algorithm 1. Start from a random permutation of the 9 tiles,
  then repeatedly add the permutation whose summed (equivalently: average) Hamming distance to
  those already chosen is largest, the first such in lexicographic order on ties. Seeded, so a
  config names its set by (size, seed).
- `tile_positions` / `cut_tiles`: a window of `puzzle` pixels (225 in the paper) at a random
  place in the image, split into a 3x3 grid of cells (75), from each a tile (64) at a random
  place inside its cell; neighbouring tiles are thus separated by random gaps and their edges
  do not line up (§3.2 "shortcuts": low-level edge continuity).
- `puzzle_tiles`: the tiles of one image with the paper's remedies against the other
  shortcuts: grayscale for a share of the images (the paper trains on 70% grayscale, 30%
  colour images against chromatic aberration), a spatial jitter of each colour tile's channels
  by up to +-2 pixels, and every tile normalised to zero mean and unit standard deviation on
  its own (against matching tiles by low-level statistics).

All of it but `permutation_set` runs on device inside the jitted step.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from pretext_jax.input_pipeline.image_augment import grayscale

GRID = 3
TILES = GRID * GRID


@functools.lru_cache(maxsize=4)
def permutation_set(count: int, seed: int, tiles: int = TILES) -> np.ndarray:
    """`count` distinct permutations of `tiles` chosen by Algorithm 1 (module docstring),
    [count, tiles] int32; row i is class i of the puzzle."""
    candidates = np.array(list(itertools.permutations(range(tiles))), np.uint8)
    if not 1 <= count <= len(candidates):
        raise ValueError(f"a set of {count} permutations of {tiles} tiles is impossible "
                         f"(1 to {len(candidates)})")
    columns = [np.ascontiguousarray(candidates[:, i]) for i in range(tiles)]
    matches = np.zeros(len(candidates), np.int32)  # summed agreements with the chosen ones
    chosen = np.zeros(len(candidates), bool)
    order = [int(np.random.default_rng(seed).integers(len(candidates)))]
    for _ in range(count - 1):
        last = candidates[order[-1]]
        chosen[order[-1]] = True
        for i in range(tiles):
            matches += columns[i] == last[i]
        # Largest summed distance = fewest summed agreements (each distance is tiles - agreements).
        order.append(int(np.argmin(np.where(chosen, np.iinfo(np.int32).max, matches))))
    return candidates[order].astype(np.int32)


def tile_positions(rng: jax.Array, height: int, width: int, puzzle: int, tile: int
                   ) -> tuple[jax.Array, jax.Array]:
    """The window's (top, left) [2], uniform over the image, and the tiles' [9, 2] in
    row-major cell order: cells of puzzle // 3 pixels, each tile at a uniform place inside its
    cell."""
    cell = puzzle // GRID
    window_key, tile_key = jax.random.split(rng)
    origin = jax.random.randint(window_key, (2,), 0,
                                jnp.array([height - puzzle + 1, width - puzzle + 1]))
    inside = jax.random.randint(tile_key, (TILES, 2), 0, cell - tile + 1)
    grid = jnp.array([(row * cell, column * cell) for row in range(GRID)
                      for column in range(GRID)])
    return origin, origin + grid + inside


def cut_tiles(image: jax.Array, positions: jax.Array, tile: int,
              channel_offsets: jax.Array | None = None) -> jax.Array:
    """[9, tile, tile, C] tiles of a [H, W, C] image at `positions` [9, 2]; channel c of tile i
    is cut `channel_offsets[i, c]` [9, C, 2] pixels away (clamped into the image)."""
    channels = image.shape[-1]
    if channel_offsets is None:
        channel_offsets = jnp.zeros((positions.shape[0], channels, 2), positions.dtype)

    def one(position: jax.Array, offsets: jax.Array) -> jax.Array:
        return jnp.stack([jax.lax.dynamic_slice(image[..., c], position + offsets[c],
                                                (tile, tile)) for c in range(channels)], -1)

    return jax.vmap(one)(positions, channel_offsets)


def normalize_tiles(tiles: jax.Array, epsilon: float = 1e-5) -> jax.Array:
    """Each tile [..., t, t, C] to zero mean and unit standard deviation over its pixels and
    channels (JigsawImageLoader.py: one mean and std per tile)."""
    mean = tiles.mean(axis=(-3, -2, -1), keepdims=True)
    std = tiles.std(axis=(-3, -2, -1), keepdims=True)
    return (tiles - mean) / (std + epsilon)


def puzzle_tiles(rng: jax.Array, image: jax.Array, puzzle: int, tile: int,
                 grayscale_probability: float, channel_jitter: int) -> jax.Array:
    """The 9 normalised tiles [9, tile, tile, 3] of a [H, W, 3] float image, in cell order
    (module docstring); grayscale with probability `grayscale_probability`, else each tile's
    channels jittered by offsets uniform in [-channel_jitter, channel_jitter]."""
    height, width = image.shape[:2]
    if height < puzzle or width < puzzle:
        raise ValueError(f"images of {height}x{width} are smaller than the puzzle ({puzzle})")
    position_key, gray_key, jitter_key = jax.random.split(rng, 3)
    _, positions = tile_positions(position_key, height, width, puzzle, tile)
    gray = jax.random.bernoulli(gray_key, grayscale_probability)
    image = jnp.where(gray, grayscale(image), image)
    offsets = jax.random.randint(jitter_key, (TILES, image.shape[-1], 2), -channel_jitter,
                                 channel_jitter + 1)
    offsets = jnp.where(gray, 0, offsets)
    return normalize_tiles(cut_tiles(image, positions, tile, offsets))


def shuffle_tiles(tiles: jax.Array, permutations: jax.Array) -> jax.Array:
    """Tiles [B, 9, ...] rearranged so that place t of row b holds tile
    permutations[b, t] (JigsawImageLoader.py)."""
    return jnp.take_along_axis(tiles, permutations.reshape(
        permutations.shape + (1,) * (tiles.ndim - 2)), axis=1)

