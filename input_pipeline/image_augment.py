"""SimCLR's augmentations as pure JAX functions of (rng, image), run on device inside the
jitted step and vmapped over the batch with one key per example. The host only delivers uint8
images; `to_float` scales them to [0, 1].

Reference: google-research/simclr tf2/data_util.py (`random_crop_with_resize`,
`color_jitter_rand`, `random_brightness` (simclrv2: multiplicative), `to_grayscale`,
`gaussian_blur`, `preprocess_for_train`) and Chen et al. 2020 Appendix A. Images are [H, W, 3]
float32 in [0, 1]. MoCo v2 and BYOL use the same pipeline with their own settings: explicit
jitter amounts (torchvision `ColorJitter(0.4, 0.4, 0.4, 0.1)`; BYOL's 0.4/0.4/0.2/0.1 with an
additive brightness shift, deepmind/byol utils/augmentations.py) and BYOL's solarisation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

GRAY_WEIGHTS = jnp.array([0.2989, 0.5870, 0.1140])  # tf.image.rgb_to_grayscale


@dataclasses.dataclass(frozen=True)
class CropConfig:
    """`distorted_bounding_box_crop` as data_util.py calls it: area fraction in `area`, aspect
    (w/h) in `aspect`, at least `min_covered` of the image kept, `attempts` tries before the
    whole image is used."""

    area: tuple[float, float] = (0.08, 1.0)
    aspect: tuple[float, float] = (3 / 4, 4 / 3)
    min_covered: float = 0.1
    attempts: int = 100


@dataclasses.dataclass(frozen=True)
class AugmentConfig:
    """data_util.py defaults: the crop (`CropConfig`; `crop=False` when the host already
    cropped, as for ImageNet-size images); jitter strength s (1.0 ImageNet, 0.5 CIFAR) gives
    brightness/contrast/saturation 0.8 s and hue 0.2 s, applied with p 0.8 in random order;
    grayscale p 0.2; blur p 0.5 with sigma in (0.1, 2) and a kernel of a tenth of the image
    (ImageNet only). `jitter` = (brightness, contrast, saturation, hue) amounts replaces the
    strength-derived ones (MoCo v2, BYOL); `additive_brightness` shifts by U(-b, b) instead of
    scaling by U(1 - b, 1 + b) (BYOL); `solarize_probability` inverts values >= 0.5 after the
    blur (BYOL, Grill et al. 2020 Table 6)."""

    image_size: int = 224
    crop: bool = True
    crop_window: CropConfig = CropConfig()
    flip: bool = True
    jitter_strength: float = 1.0
    jitter_probability: float = 0.8
    grayscale_probability: float = 0.2
    blur_probability: float = 0.5
    jitter: tuple[float, float, float, float] | None = None
    additive_brightness: bool = False
    solarize_probability: float = 0.0

    def jitter_amounts(self) -> tuple[float, float, float, float]:
        return self.jitter or jitter_amounts(self.jitter_strength)


def jitter_amounts(strength: float) -> tuple[float, float, float, float]:
    """data_util.py's (brightness, contrast, saturation, hue) for a jitter strength s."""
    return 0.8 * strength, 0.8 * strength, 0.8 * strength, 0.2 * strength


def to_float(images: jax.Array) -> jax.Array:
    return images.astype(jnp.float32) / 255.0


def window_from_uniforms(xp: Any, uniforms: Any, height: int, width: int,
                         crop: CropConfig) -> Any:
    """(top, left, crop height, crop width) from `uniforms` [4, attempts] in [0, 1), computed
    as TensorFlow's SampleDistortedBoundingBox kernel does (sample_distorted_bounding_box_op.cc
    `GenerateRandomCrop`): per attempt an aspect ~ U(aspect), a height uniform over the integers
    whose area fits `area` (width = round(height * aspect), one step of rounding repair), an
    offset uniform over [0, size - crop); the first attempt that fits and keeps `min_covered`
    of the image wins, else the whole image. `xp` is numpy (host) or jax.numpy (device), so
    host and device crops are the same function of the same draws."""
    u_aspect, u_height, u_top, u_left = (uniforms[i].astype(xp.float32) for i in range(4))
    ratio = crop.aspect[0] + u_aspect * (crop.aspect[1] - crop.aspect[0])
    min_area = xp.float32(crop.area[0] * height * width)
    max_area = xp.float32(crop.area[1] * height * width)
    crop_h = xp.rint(xp.sqrt(min_area / ratio))
    max_h = xp.rint(xp.sqrt(max_area / ratio))
    widest = xp.floor((width + 0.5 - 1e-7) / ratio)
    widest = xp.where(xp.rint(widest * ratio) > width, widest - 1, widest)
    max_h = xp.minimum(xp.where(xp.rint(max_h * ratio) > width, widest, max_h), height)
    crop_h = xp.minimum(crop_h, max_h)
    crop_h = crop_h + xp.floor(u_height * (max_h - crop_h + 1))
    crop_w = xp.rint(crop_h * ratio)
    grow = crop_w * crop_h < min_area
    crop_h = xp.where(grow, crop_h + 1, crop_h)
    crop_w = xp.where(grow, xp.rint(crop_h * ratio), crop_w)
    shrink = crop_w * crop_h > max_area
    crop_h = xp.where(shrink, crop_h - 1, crop_h)
    crop_w = xp.where(shrink, xp.rint(crop_h * ratio), crop_w)
    area = crop_w * crop_h
    fits = ((area >= min_area) & (area <= max_area) & (crop_w <= width) & (crop_h <= height)
            & (crop_w > 0) & (crop_h > 0) & (area >= crop.min_covered * height * width))
    top = xp.where(crop_h < height, xp.floor(u_top * (height - crop_h)), 0)
    left = xp.where(crop_w < width, xp.floor(u_left * (width - crop_w)), 0)
    first = xp.argmax(fits)
    found = fits.any()
    return xp.stack([xp.where(found, top[first], 0), xp.where(found, left[first], 0),
                     xp.where(found, crop_h[first], height),
                     xp.where(found, crop_w[first], width)]).astype(xp.float32)


def crop_window(rng: jax.Array, height: int, width: int, crop: CropConfig) -> jax.Array:
    """`window_from_uniforms` on device with draws from `rng`."""
    uniforms = jax.random.uniform(rng, (4, crop.attempts))
    return window_from_uniforms(jnp, uniforms, height, width, crop)


def resized_crop(image: jax.Array, window: jax.Array, size: int) -> jax.Array:
    """The window [top, left, h, w] resized to size x size with bilinear interpolation."""
    top, left, crop_h, crop_w = window
    scale = jnp.stack([size / crop_h, size / crop_w])
    translation = -jnp.stack([top, left]) * scale
    return jax.image.scale_and_translate(image, (size, size, image.shape[2]), (0, 1), scale,
                                         translation, method="linear", antialias=False)


def rgb_to_hsv(rgb: jax.Array) -> jax.Array:
    """tf.image.rgb_to_hsv: hue in [0, 1)."""
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    value = rgb.max(-1)
    delta = value - rgb.min(-1)
    saturation = jnp.where(value > 0, delta / jnp.where(value > 0, value, 1.0), 0.0)
    safe = jnp.where(delta > 0, delta, 1.0)
    hue = jnp.where(value == r, (g - b) / safe,
                    jnp.where(value == g, 2.0 + (b - r) / safe, 4.0 + (r - g) / safe))
    hue = jnp.where(delta > 0, (hue / 6.0) % 1.0, 0.0)
    return jnp.stack([hue, saturation, value], -1)


def hsv_to_rgb(hsv: jax.Array) -> jax.Array:
    """tf.image.hsv_to_rgb."""
    hue, saturation, value = hsv[..., 0], hsv[..., 1], hsv[..., 2]
    channels = jnp.stack([5.0, 3.0, 1.0])  # r, g, b offsets of the piecewise-linear hue
    k = (channels + hue[..., None] * 6.0) % 6.0
    ramp = jnp.clip(jnp.minimum(k, 4.0 - k), 0.0, 1.0)
    return value[..., None] - value[..., None] * saturation[..., None] * ramp


def brightness(image: jax.Array, factor: jax.Array) -> jax.Array:
    return image * factor


def contrast(image: jax.Array, factor: jax.Array) -> jax.Array:
    mean = image.mean(axis=(0, 1), keepdims=True)
    return (image - mean) * factor + mean


def saturation(image: jax.Array, factor: jax.Array) -> jax.Array:
    hsv = rgb_to_hsv(image)
    return hsv_to_rgb(hsv.at[..., 1].set(jnp.clip(hsv[..., 1] * factor, 0.0, 1.0)))


def hue(image: jax.Array, delta: jax.Array) -> jax.Array:
    hsv = rgb_to_hsv(image)
    return hsv_to_rgb(hsv.at[..., 0].set((hsv[..., 0] + delta) % 1.0))


def color_jitter(rng: jax.Array, image: jax.Array,
                 strength: float | tuple[float, float, float, float],
                 additive_brightness: bool = False) -> jax.Array:
    """Brightness, contrast, saturation (factors ~ U(1 - a, 1 + a)) and hue (shift ~ U(-h, h))
    in a random order, clipping to [0, 1] after each (`color_jitter_rand`). `strength` is s
    (a = 0.8 s, h = 0.2 s) or the four amounts; `additive_brightness` adds U(-a, a) instead."""
    amounts = jitter_amounts(strength) if isinstance(strength, int | float) else strength
    order_key, *keys = jax.random.split(rng, 5)
    factors = [jax.random.uniform(k, minval=max(1.0 - a, 0.0), maxval=1.0 + a)
               for k, a in zip(keys[:3], amounts[:3], strict=True)]
    shift = jax.random.uniform(keys[3], minval=-amounts[3], maxval=amounts[3])
    delta = jax.random.uniform(keys[0], minval=-amounts[0], maxval=amounts[0])
    operations = [(lambda x: x + delta) if additive_brightness
                  else (lambda x: brightness(x, factors[0])),
                  lambda x: contrast(x, factors[1]),
                  lambda x: saturation(x, factors[2]), lambda x: hue(x, shift)]
    for step in jax.random.permutation(order_key, 4):
        image = jnp.clip(jax.lax.switch(step, operations, image), 0.0, 1.0)
    return image


def grayscale(image: jax.Array) -> jax.Array:
    gray = image @ GRAY_WEIGHTS
    return jnp.repeat(gray[..., None], 3, axis=-1)


def solarize(image: jax.Array, threshold: float = 0.5) -> jax.Array:
    """Values at or above `threshold` become 1 - value (BYOL augmentations.py `solarize`)."""
    return jnp.where(image < threshold, image, 1.0 - image)


def gaussian_blur(image: jax.Array, sigma: jax.Array, kernel_size: int) -> jax.Array:
    """Separable Gaussian of `sigma` with a (2 * (kernel_size // 2) + 1)-tap kernel, zero
    padding ('SAME'), as data_util.py `gaussian_blur`. Written as a weighted sum of shifted
    copies: a vmapped `jnp.convolve` made XLA's CPU compiler abort (free(): invalid pointer)
    on meshes with a `tensor` axis."""
    radius = kernel_size // 2
    offsets = jnp.arange(-radius, radius + 1, dtype=jnp.float32)
    kernel = jnp.exp(-(offsets ** 2) / (2.0 * sigma ** 2))
    kernel = kernel / kernel.sum()

    def along(x: jax.Array, axis: int) -> jax.Array:
        padding = [(0, 0)] * x.ndim
        padding[axis] = (radius, radius)
        padded = jnp.pad(x, padding)
        return sum(kernel[tap] * jax.lax.slice_in_dim(padded, tap, tap + x.shape[axis],
                                                      axis=axis)
                   for tap in range(2 * radius + 1))

    return along(along(image, 0), 1)


def augment(rng: jax.Array, image: jax.Array, config: AugmentConfig) -> jax.Array:
    """One view of a [H, W, 3] float image in [0, 1] (`preprocess_for_train`)."""
    keys = jax.random.split(rng, 8)
    height, width = image.shape[:2]
    if config.crop:
        window = crop_window(keys[0], height, width, config.crop_window)
        image = resized_crop(image, window, config.image_size)
    if config.flip:
        image = jnp.where(jax.random.bernoulli(keys[1]), image[:, ::-1], image)
    amounts = config.jitter_amounts()
    if any(a > 0 for a in amounts):
        jittered = color_jitter(keys[2], image, amounts, config.additive_brightness)
        image = jnp.where(jax.random.bernoulli(keys[3], config.jitter_probability), jittered,
                          image)
    image = jnp.where(jax.random.bernoulli(keys[4], config.grayscale_probability),
                      grayscale(image), image)
    if config.blur_probability > 0:
        sigma = jax.random.uniform(keys[5], minval=0.1, maxval=2.0)
        blurred = gaussian_blur(image, sigma, config.image_size // 10)
        image = jnp.where(jax.random.bernoulli(keys[6], config.blur_probability), blurred,
                          image)
    if config.solarize_probability > 0:
        image = jnp.where(jax.random.bernoulli(keys[7], config.solarize_probability),
                          solarize(image), image)
    return jnp.clip(image, 0.0, 1.0)


def augment_batch(rng: jax.Array, images: jax.Array, config: AugmentConfig) -> jax.Array:
    """[B, H, W, 3] uint8 -> [B, size, size, 3] float views, one key per example."""
    keys = jax.random.split(rng, images.shape[0])
    return jax.vmap(lambda k, x: augment(k, x, config))(keys, to_float(images))


def padded_crop(rng: jax.Array, image: jax.Array, padding: int, mode: str = "constant"
                ) -> jax.Array:
    """torchvision RandomCrop(size, padding): the [H, W, C] image zero-padded by `padding` on
    every side, then a window of the original size at an offset uniform in [0, 2 padding] per
    axis (RotNet's CIFAR augmentation, with a horizontal flip). `mode="reflect"` mirrors the
    image into the border without repeating the edge pixel: AMDIM's CIFAR translation
    (datasets.py `RandomTranslateWithReflect`, a shift uniform in [-padding, padding] per
    axis)."""
    height, width, channels = image.shape
    padded = jnp.pad(image, ((padding, padding), (padding, padding), (0, 0)), mode=mode)
    top, left = jax.random.randint(rng, (2,), 0, 2 * padding + 1)
    return jax.lax.dynamic_slice(padded, (top, left, 0), (height, width, channels))


def rotations(images: jax.Array) -> tuple[jax.Array, jax.Array]:
    """RotNet's four copies of every [B, S, S, C] image: [4B, S, S, C] with the copies rotated
    counter-clockwise by k x 90 degrees in block k (as np.rot90(image, k); dataloader.py
    `rotate_img`), and the labels k [4B]."""
    if images.shape[1] != images.shape[2]:
        raise ValueError(f"rotations need square images, not {images.shape[1:3]}")
    rotated = [jnp.rot90(images, k, axes=(1, 2)) for k in range(4)]
    labels = jnp.repeat(jnp.arange(4, dtype=jnp.int32), images.shape[0])
    return jnp.concatenate(rotated), labels
