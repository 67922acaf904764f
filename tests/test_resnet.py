"""ResNet backbone: parity with HF `ResNetModel` (eval mode), BatchNorm statistics over the
global batch on a sharded mesh, and the HF round trip."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from parity_utils import Parity, assert_close, converted, random_model

from pretext_jax.errors import UserError
from pretext_jax.models.resnet import ResNet, ResNetConfig
from pretext_jax.pretrain import hf
from pretext_jax.pretrain.mesh import make_mesh

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("deterministic_torch")

# HF ResNetConfig of ResNet-18 and ResNet-50 layouts with 8 stem channels.
RESNET18 = dict(embedding_size=8, hidden_sizes=[8, 16, 32, 64], depths=[2, 2, 2, 2],
                layer_type="basic")
RESNET50 = dict(embedding_size=8, hidden_sizes=[32, 64, 128, 256], depths=[3, 4, 6, 3],
                layer_type="bottleneck")


def hf_resnet(seed: int, **config):
    """HF ResNetModel with perturbed BatchNorm affine parameters and running statistics taken
    from a batch (so activations stay O(1) through the depth)."""
    torch.manual_seed(seed)
    model = transformers.ResNetModel(transformers.ResNetConfig(**config))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.weight.add_(0.2 * torch.randn_like(module.weight))
                module.bias.add_(0.2 * torch.randn_like(module.bias))
                module.momentum = None  # running stats = the calibration batch's
                module.reset_running_stats()
        model.train()
        model(torch.randn(8, 3, 33, 33))
    return model.eval()


def images(seed: int = 0, size: int = 33) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((3, 3, size, size)).astype(np.float32)


def hf_features(model, pixels):
    out = model(pixels)
    return {"features": out.last_hidden_state, "pooled": out.pooler_output[:, :, 0, 0]}


def our_features(model: ResNet, pixels):
    nhwc = pixels.transpose(0, 2, 3, 1)
    return {"features": model.feature_map(nhwc, train=False).transpose(0, 3, 1, 2),
            "pooled": model(nhwc, train=False)}


# Features and pooled output within 1e-5 absolute and relative (|a - b| <= tol + tol |b|):
# after 17-50 convolutions + BatchNorms, float32 results of two correct implementations differ
# by summation order at the 1e-5 relative level.
RESNET = Parity("ResNetModel", hf_features, our_features, rtol=1e-5)


def compare(model, reference, pixels, tolerance):
    """`RESNET`'s outputs within `tolerance`, absolute and relative."""
    assert_close(RESNET.our_outputs(model, pixels), RESNET.hf_outputs(reference, pixels),
                 tolerance, rtol=tolerance)


def test_parity_with_hf_resnet18_layout_float32(tmp_path):
    reference = hf_resnet(0, **RESNET18)
    model = converted(reference, tmp_path)
    assert isinstance(model, ResNet) and model.config.depth == 18
    assert model.config.base_width == 8
    compare(model, reference, images(0), 1e-5)


def test_parity_with_hf_resnet50_layout_in_float64(tmp_path):
    """50 layers of convolutions in float32 differ by summation order alone (~1e-5 relative);
    in float64 the two computations agree to 1e-9, which pins down the arithmetic."""
    reference = hf_resnet(1, **RESNET50)
    with jax.enable_x64(True):
        model = converted(reference, tmp_path, dtype="float64")
        assert model.config.depth == 50
        compare(model, reference.double(), images(1).astype(np.float64), 1e-9)


def test_round_trip_through_transformers(tmp_path):
    config = ResNetConfig(depth=18, base_width=4)
    ours = random_model(ResNet, config, 0)
    rng = np.random.default_rng(1)
    for _, variable in nnx.to_flat_state(nnx.state(ours, nnx.BatchStat)):
        shape = variable.get_value().shape  # positive, so also valid variances
        variable.set_value(jnp.asarray(rng.uniform(0.5, 1.5, shape), jnp.float32))
    RESNET.round_trip(ours, tmp_path, images(2, 17))
    cifar = nnx.eval_shape(lambda: ResNet(ResNetConfig(depth=18, stem="cifar", base_width=4),
                                          rngs=nnx.Rngs(0)))
    with pytest.raises(UserError, match="CIFAR"):
        hf.save(cifar, tmp_path / "cifar")


def test_batch_norm_statistics_are_over_the_global_batch():
    """Train mode on a batch sharded over 8 devices: the stem's BatchNorm normalises with the
    global batch's mean and (biased) variance and moves its running mean towards the global
    mean, exactly as numpy computes them over the whole batch."""
    config = ResNetConfig(depth=18, stem="cifar", base_width=4)
    model = ResNet(config, rngs=nnx.Rngs(0))
    mesh = make_mesh(8, 1, 1)
    pixels = np.random.default_rng(3).standard_normal((16, 8, 8, 3)).astype(np.float32)
    pixels[8:] += 3.0  # the second half of the batch (other devices) differs
    sharded = jax.device_put(pixels, NamedSharding(mesh, PartitionSpec("data")))
    kernel = np.asarray(model.stem.convolution.kernel[...])

    @nnx.jit
    def stem(model, x):
        return model.stem(x, train=True)

    out = np.asarray(stem(model, sharded))
    conv = np.asarray(jax.lax.conv_general_dilated(
        jnp.asarray(pixels), jnp.asarray(kernel), (1, 1), ((1, 1), (1, 1)),
        dimension_numbers=("NHWC", "HWIO", "NHWC")))
    mean, var = conv.mean(axis=(0, 1, 2)), conv.var(axis=(0, 1, 2))
    np.testing.assert_allclose(out, (conv - mean) / np.sqrt(var + 1e-5), atol=1e-4)
    np.testing.assert_allclose(np.asarray(model.stem.normalization.mean[...]), 0.1 * mean,
                               atol=1e-6)
