"""SimCLR augmentations: shapes, value range, identity at zero strength, determinism per key,
crop area/aspect distribution, colour-space conversions against matplotlib."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from matplotlib.colors import hsv_to_rgb as reference_hsv_to_rgb
from matplotlib.colors import rgb_to_hsv as reference_rgb_to_hsv

from pretext_jax.input_pipeline import image_augment as aug


def image(seed: int = 0, size: int = 32) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).random((size, size, 3)), jnp.float32)


def test_hsv_conversions_match_matplotlib():
    rgb = np.random.default_rng(0).random((500, 3)).astype(np.float32)
    rgb[:10] = rgb[:10, :1]  # greys: hue and saturation 0
    hsv = np.asarray(aug.rgb_to_hsv(jnp.asarray(rgb)))
    np.testing.assert_allclose(hsv, reference_rgb_to_hsv(rgb), atol=1e-5)
    np.testing.assert_allclose(np.asarray(aug.hsv_to_rgb(jnp.asarray(hsv))),
                               reference_hsv_to_rgb(hsv), atol=1e-5)


def test_zero_strength_and_full_crop_are_identities():
    x = image()
    key = jax.random.key(0)
    np.testing.assert_allclose(aug.color_jitter(key, x, 0.0), x, atol=1e-5)
    window = aug.crop_window(key, 32, 32, aug.CropConfig(area=(1.0, 1.0), aspect=(1.0, 1.0)))
    np.testing.assert_array_equal(window, [0, 0, 32, 32])
    np.testing.assert_allclose(aug.resized_crop(x, window, 32), x, atol=1e-6)
    np.testing.assert_allclose(aug.gaussian_blur(x, jnp.float32(1e-3), 5), x, atol=1e-6)


def reference_crop(u: np.ndarray, height: int, width: int, area: tuple[float, float],
                   aspect: tuple[float, float], min_covered: float) -> list[int]:
    """TF's SampleDistortedBoundingBox (GenerateRandomCrop + SatisfiesOverlapConstraints),
    restated attempt by attempt with Python ints; u[:, i] are attempt i's four draws."""
    min_area, max_area = area[0] * height * width, area[1] * height * width
    for a_u, h_u, y_u, x_u in u.T.astype(np.float64):
        ratio = aspect[0] + a_u * (aspect[1] - aspect[0])
        crop_h = round(np.sqrt(min_area / ratio))
        max_h = round(np.sqrt(max_area / ratio))
        if round(max_h * ratio) > width:
            max_h = int((width + 0.5 - 1e-7) / ratio)
            if round(max_h * ratio) > width:
                max_h -= 1
        max_h = min(max_h, height)
        crop_h = min(crop_h, max_h)
        crop_h += int(h_u * (max_h - crop_h + 1))
        crop_w = round(crop_h * ratio)
        if crop_w * crop_h < min_area:
            crop_h += 1
            crop_w = round(crop_h * ratio)
        if crop_w * crop_h > max_area:
            crop_h -= 1
            crop_w = round(crop_h * ratio)
        fits = (min_area <= crop_w * crop_h <= max_area and 0 < crop_w <= width
                and 0 < crop_h <= height and crop_w * crop_h >= min_covered * height * width)
        if fits:
            top = int(y_u * (height - crop_h)) if crop_h < height else 0
            left = int(x_u * (width - crop_w)) if crop_w < width else 0
            return [top, left, crop_h, crop_w]
    return [0, 0, height, width]


@pytest.mark.parametrize("shape", [(224, 224), (375, 500), (32, 32), (40, 17)])
def test_crop_window_is_tf_sample_distorted_bounding_box_on_host_and_device(shape):
    """Host (numpy) and device (jax.numpy) windows equal a plain restatement of TF's kernel
    for the same draws, on square, landscape, tiny and narrow images."""
    crop = aug.CropConfig(attempts=6)
    rng = np.random.default_rng(sum(shape))
    for _ in range(300):
        u = rng.random((4, crop.attempts), np.float32)
        expected = reference_crop(u, *shape, crop.area, crop.aspect, crop.min_covered)
        np.testing.assert_array_equal(aug.window_from_uniforms(np, u, *shape, crop), expected)
        np.testing.assert_array_equal(
            np.asarray(aug.window_from_uniforms(jnp, jnp.asarray(u), *shape, crop)), expected)


def test_crop_area_and_aspect_distribution():
    keys = jax.random.split(jax.random.key(1), 4000)
    windows = np.asarray(jax.vmap(lambda k: aug.crop_window(k, 224, 224, aug.CropConfig()))(
        keys))
    top, left, height, width = windows.T
    assert (top >= 0).all() and (left >= 0).all()
    assert (top + height <= 224).all() and (left + width <= 224).all()
    area = height * width / 224 ** 2
    aspect = width / height
    # min_object_covered 0.1 (data_util.py) rejects the areas between 0.08 and 0.1.
    assert area.min() >= 0.1 and area.max() <= 1.0
    full = (height == 224) & (width == 224)
    assert full.mean() < 0.01  # the fallback is rare
    assert (aspect[~full] >= 0.74).all() and (aspect[~full] <= 1.35).all()
    # The side, not the area, is uniform: area = h^2 x aspect with h ~ U(sqrt(0.08/r),
    # sqrt(1/r)) x 224 gives a mean area near 0.45 before the large crops that do not fit.
    assert 0.35 < area.mean() < 0.5
    assert abs(np.median(aspect) - 1.0) < 0.05


def test_jitter_changes_colours_within_range_and_grayscale_is_grey():
    x = image(1)
    jittered = np.asarray(aug.color_jitter(jax.random.key(2), x, 1.0))
    assert jittered.min() >= 0.0 and jittered.max() <= 1.0
    assert np.abs(jittered - np.asarray(x)).mean() > 0.01
    gray = np.asarray(aug.grayscale(x))
    np.testing.assert_allclose(gray[..., 0], np.asarray(x) @ [0.2989, 0.5870, 0.1140],
                               atol=1e-6)
    assert (gray[..., 0] == gray[..., 1]).all() and (gray[..., 1] == gray[..., 2]).all()


@pytest.mark.parametrize("preset", ["cifar", "imagenet"])
def test_augment_batch_shapes_range_and_determinism(preset):
    config = (aug.AugmentConfig(image_size=32, jitter_strength=0.5, blur_probability=0.0)
              if preset == "cifar" else aug.AugmentConfig(image_size=48))
    images = jnp.asarray(np.random.default_rng(3).integers(0, 256, (6, 40, 40, 3)), jnp.uint8)
    run = jax.jit(lambda k, x: aug.augment_batch(k, x, config))
    first = np.asarray(run(jax.random.key(4), images))
    assert first.shape == (6, config.image_size, config.image_size, 3)
    assert first.dtype == np.float32 and first.min() >= 0.0 and first.max() <= 1.0
    np.testing.assert_array_equal(first, np.asarray(run(jax.random.key(4), images)))
    other = np.asarray(run(jax.random.key(5), images))
    assert not np.allclose(first, other)
    # Every example has its own key: identical inputs give different views.
    same = jnp.broadcast_to(images[:1], images.shape)
    views = np.asarray(run(jax.random.key(6), same))
    assert len({v.tobytes() for v in views}) == len(views)


def test_blur_is_normalised_and_smooths():
    constant = np.asarray(aug.gaussian_blur(jnp.full((20, 20, 3), 0.5), jnp.float32(1.5), 9))
    np.testing.assert_allclose(constant[4:-4, 4:-4], 0.5, atol=1e-6)  # zeros enter at edges only
    assert constant[0, 0, 0] < 0.5
    noise = image(5, 48)
    blurred = np.asarray(aug.gaussian_blur(noise, jnp.float32(2.0), 9))
    assert blurred[8:-8, 8:-8].std() < 0.5 * np.asarray(noise)[8:-8, 8:-8].std()
