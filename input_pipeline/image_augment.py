"""SimCLR's augmentations as pure JAX functions of (rng, image), run on device inside the
jitted step and vmapped over the batch with one key per example. The host only delivers uint8
images; `to_float` scales them to [0, 1].

Reference: google-research/simclr tf2/data_util.py (`random_crop_with_resize`,
`color_jitter_rand`, `random_brightness` (simclrv2: multiplicative), `to_grayscale`,
`gaussian_blur`, `preprocess_for_train`) and Chen et al. 2020 Appendix A. Images are [H, W, 3]
float32 in [0, 1].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

GRAY_WEIGHTS = jnp.array([0.2989, 0.5870, 0.1140])  # tf.image.rgb_to_grayscale


@dataclasses.dataclass(frozen=True)
class AugmentConfig:
    """data_util.py defaults: crop area (0.08, 1) and aspect (3/4, 4/3); jitter strength s
    (1.0 ImageNet, 0.5 CIFAR) gives brightness/contrast/saturation 0.8 s and hue 0.2 s, applied
    with p 0.8 in random order; grayscale p 0.2; blur p 0.5 with sigma in (0.1, 2) and a kernel
    of a tenth of the image (ImageNet only)."""

    image_size: int = 224
    crop_area: tuple[float, float] = (0.08, 1.0)
    crop_aspect: tuple[float, float] = (3 / 4, 4 / 3)
    flip: bool = True
    jitter_strength: float = 1.0
    jitter_probability: float = 0.8
    grayscale_probability: float = 0.2
    blur_probability: float = 0.5
    crop_attempts: int = 10


def to_float(images: jax.Array) -> jax.Array:
    return images.astype(jnp.float32) / 255.0


def crop_window(rng: jax.Array, height: int, width: int, area: tuple[float, float],
                aspect: tuple[float, float], attempts: int) -> jax.Array:
    """(top, left, crop height, crop width): area fraction ~ U(area), aspect (w/h) ~ U(aspect)
    as tf.image.sample_distorted_bounding_box draws them; the first of `attempts` draws that
    fits, else the whole image."""
    area_key, aspect_key, y_key, x_key = jax.random.split(rng, 4)
    areas = jax.random.uniform(area_key, (attempts,), minval=area[0], maxval=area[1])
    aspects = jax.random.uniform(aspect_key, (attempts,), minval=aspect[0], maxval=aspect[1])
    target = areas * height * width
    crop_w = jnp.round(jnp.sqrt(target * aspects))
    crop_h = jnp.round(jnp.sqrt(target / aspects))
    fits = (crop_w <= width) & (crop_h <= height) & (crop_w >= 1) & (crop_h >= 1)
    first = jnp.argmax(fits)
    crop_h = jnp.where(fits.any(), crop_h[first], height)
    crop_w = jnp.where(fits.any(), crop_w[first], width)
    top = jnp.floor(jax.random.uniform(y_key) * (height - crop_h + 1))
    left = jnp.floor(jax.random.uniform(x_key) * (width - crop_w + 1))
    return jnp.stack([top, left, crop_h, crop_w])


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


def color_jitter(rng: jax.Array, image: jax.Array, strength: float) -> jax.Array:
    """Brightness, contrast, saturation (factors ~ U(1 - 0.8 s, 1 + 0.8 s)) and hue (shift ~
    U(-0.2 s, 0.2 s)) in a random order, clipping to [0, 1] after each (`color_jitter_rand`)."""
    order_key, *keys = jax.random.split(rng, 5)
    spread = 0.8 * strength
    factors = [jax.random.uniform(k, minval=max(1.0 - spread, 0.0), maxval=1.0 + spread)
               for k in keys[:3]]
    shift = jax.random.uniform(keys[3], minval=-0.2 * strength, maxval=0.2 * strength)
    operations = [lambda x: brightness(x, factors[0]), lambda x: contrast(x, factors[1]),
                  lambda x: saturation(x, factors[2]), lambda x: hue(x, shift)]
    for step in jax.random.permutation(order_key, 4):
        image = jnp.clip(jax.lax.switch(step, operations, image), 0.0, 1.0)
    return image


def grayscale(image: jax.Array) -> jax.Array:
    gray = image @ GRAY_WEIGHTS
    return jnp.repeat(gray[..., None], 3, axis=-1)


def gaussian_blur(image: jax.Array, sigma: jax.Array, kernel_size: int) -> jax.Array:
    """Separable Gaussian of `sigma` with a (2 * (kernel_size // 2) + 1)-tap kernel, zero
    padding ('SAME'), as data_util.py `gaussian_blur`."""
    radius = kernel_size // 2
    offsets = jnp.arange(-radius, radius + 1, dtype=jnp.float32)
    kernel = jnp.exp(-(offsets ** 2) / (2.0 * sigma ** 2))
    kernel = kernel / kernel.sum()

    def along(x: jax.Array, axis: int) -> jax.Array:
        moved = jnp.moveaxis(x, axis, -1)
        rows = moved.reshape(-1, moved.shape[-1])
        out = jax.vmap(lambda row: jnp.convolve(row, kernel, mode="same"))(rows)
        return jnp.moveaxis(out.reshape(moved.shape), -1, axis)

    return along(along(image, 0), 1)


def augment(rng: jax.Array, image: jax.Array, config: AugmentConfig) -> jax.Array:
    """One view of a [H, W, 3] float image in [0, 1] (`preprocess_for_train`)."""
    keys = jax.random.split(rng, 8)
    height, width = image.shape[:2]
    window = crop_window(keys[0], height, width, config.crop_area, config.crop_aspect,
                         config.crop_attempts)
    image = resized_crop(image, window, config.image_size)
    if config.flip:
        image = jnp.where(jax.random.bernoulli(keys[1]), image[:, ::-1], image)
    if config.jitter_strength > 0:
        jittered = color_jitter(keys[2], image, config.jitter_strength)
        image = jnp.where(jax.random.bernoulli(keys[3], config.jitter_probability), jittered,
                          image)
    image = jnp.where(jax.random.bernoulli(keys[4], config.grayscale_probability),
                      grayscale(image), image)
    if config.blur_probability > 0:
        sigma = jax.random.uniform(keys[5], minval=0.1, maxval=2.0)
        blurred = gaussian_blur(image, sigma, config.image_size // 10)
        image = jnp.where(jax.random.bernoulli(keys[6], config.blur_probability), blurred,
                          image)
    return jnp.clip(image, 0.0, 1.0)


def augment_batch(rng: jax.Array, images: jax.Array, config: AugmentConfig) -> jax.Array:
    """[B, H, W, 3] uint8 -> [B, size, size, 3] float views, one key per example."""
    keys = jax.random.split(rng, images.shape[0])
    return jax.vmap(lambda k, x: augment(k, x, config))(keys, to_float(images))
