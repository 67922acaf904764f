"""ResNet's HF conversion (transformers models/resnet/modeling_resnet.py,
configuration_resnet.py): `ResNetModel` (also read from `ResNetForImageClassification`) <->
`models.resnet.ResNet`, the backbone of SimCLR, MoCo and BYOL."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from pretext_jax.errors import UserError
from pretext_jax.models.hf.conversion import Converter, Tensor, register
from pretext_jax.models.resnet import DEPTHS, ResNet, ResNetConfig

TORCH_CONV = (2, 3, 1, 0)  # torch Conv2d weight [O, I, H, W] -> flax [H, W, I, O]


def _conv_bn(hf: str, ours: str) -> list[Tensor]:
    """HF `ResNetConvLayer`/`ResNetShortCut` (`convolution`, `normalization`) <-> our `ConvBN`."""
    return [Tensor(f"{hf}.convolution.weight", f"{ours}.convolution.kernel", TORCH_CONV),
            Tensor(f"{hf}.normalization.weight", f"{ours}.normalization.scale"),
            Tensor(f"{hf}.normalization.bias", f"{ours}.normalization.bias"),
            Tensor(f"{hf}.normalization.running_mean", f"{ours}.normalization.mean"),
            Tensor(f"{hf}.normalization.running_var", f"{ours}.normalization.var")]


def tensors(config: ResNetConfig) -> tuple[Tensor, ...]:
    """`ResNetModel` under the `resnet.` prefix (as in `ResNetForImageClassification`):
    `embedder.embedder`, then `encoder.stages.{s}.layers.{b}` with `shortcut` and `layer.{k}`."""
    tensors = _conv_bn("resnet.embedder.embedder", "stem")
    in_channels = config.stem_width
    for s, (depth, width) in enumerate(zip(config.stage_depths, config.stage_widths,
                                           strict=True)):
        for b in range(depth):
            hf, ours = f"resnet.encoder.stages.{s}.layers.{b}", f"stages.{s}.{b}"
            convs = 2 if config.block == "basic" else 3
            for k in range(convs):
                tensors += _conv_bn(f"{hf}.layer.{k}", f"{ours}.layers.{k}")
            if b == 0 and (in_channels != width or s > 0):
                tensors += _conv_bn(f"{hf}.shortcut", f"{ours}.shortcut")
        in_channels = width
    return tuple(tensors)


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> ResNetConfig:
    """A HF `ResNetConfig` of a v1.5 ResNet-18/34/50/101 (any stem width) -> ours."""
    depths = tuple(hf.get("depths", (3, 4, 6, 3)))
    block = hf.get("layer_type", "bottleneck")
    matches = [d for d, (b, stages) in DEPTHS.items() if (b, stages) == (block, depths)]
    config = None
    if (matches and not hf.get("downsample_in_first_stage", False)
            and not hf.get("downsample_in_bottleneck", False)
            and hf.get("hidden_act", "relu") == "relu"):
        config = ResNetConfig(**{"depth": matches[0], "base_width": hf.get("embedding_size", 64),
                                 "num_channels": hf.get("num_channels", 3), **overrides})
    if config is None or list(hf.get("hidden_sizes", config.stage_widths)) != list(
            config.stage_widths):
        raise UserError(f"config.json describes a ResNet ({block}, depths {list(depths)}, "
                        f"hidden_sizes {hf.get('hidden_sizes')}) that is not a v1.5 "
                        f"ResNet-{sorted(DEPTHS)} with stage widths 1, 2, 4, 8 x the stem's "
                        "(x4 for bottlenecks); pass one that is")
    return config


def config_to_hf(config: ResNetConfig) -> dict[str, Any]:
    if config.stem != "imagenet":
        raise UserError("HF ResNetModel has only the ImageNet stem; a CIFAR-stem ResNet cannot "
                        "be exported to it (save it as a pretext model directory instead)")
    return {"model_type": "resnet", "architectures": ["ResNetModel"],
            "num_channels": config.num_channels, "embedding_size": config.stem_width,
            "hidden_sizes": list(config.stage_widths), "depths": list(config.stage_depths),
            "layer_type": config.block, "hidden_act": "relu",
            "downsample_in_first_stage": False, "downsample_in_bottleneck": False}


register("resnet", Converter(
    model_type="resnet", model_class=ResNet,
    architectures=("ResNetModel", "ResNetForImageClassification"),
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, tensors=tensors, prefix="resnet.",
    ignored=("num_batches_tracked", "classifier.1.weight", "classifier.1.bias"),
    buffers=lambda config: {
        t.hf.replace(".running_mean", ".num_batches_tracked"): np.zeros((), np.int64)
        for t in tensors(config) if t.hf.endswith(".running_mean")},
))
