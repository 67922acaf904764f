"""Semi-supervised image fine-tuning (`run.py finetune --task semi`, objectives/semi.py): the
class-balanced label subset, the start from an image method's backbone or its random init,
SimCLR's fine-tuning recipe, exact resume, `run.py eval`, and the refusal of a text model."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import jax
import numpy as np
import pytest
from flax import nnx
from parity_utils import hf_reference
from tfds_utils import write_cifar10_folder

from pretext_jax import run
from pretext_jax.errors import UserError
from pretext_jax.objectives.semi import SemiModelConfig, balanced_subset, build_semi, epochs_for
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.finetune import (
    RESULTS_FILE,
    SUBSET_FILE,
    evaluate,
    finetune,
    finetune_config,
)
from pretext_jax.pretrain.loading import load_model, load_pretrained
from pretext_jax.pretrain.trainer import Trainer

FAST = ["train.batch_size=16", "train.progress=false", "examples.label_fraction=0.5",
        "optim.learning_rate=0.1"]


@pytest.fixture(scope="module")
def colours(tmp_path_factory):
    """A CIFAR-10-format folder of 192 images (160 for training), each one random colour with
    pixel noise, labelled by its brightest channel (3 classes)."""
    rng = np.random.default_rng(0)

    def batch():
        colours = rng.integers(0, 256, (32, 1, 1, 3))
        pixels = np.clip(colours + rng.normal(0, 12, (32, 32, 32, 3)), 0, 255)
        return pixels, colours[:, 0, 0].argmax(-1)

    return write_cifar10_folder(tmp_path_factory.mktemp("semi_colours"), batch)


@pytest.fixture(scope="module")
def simclr_run(tmp_path_factory, colours):
    """A SimCLR workdir (a 4-wide ResNet-18, 2 steps): an image method's starting point."""
    workdir = tmp_path_factory.mktemp("semi_simclr") / "run"
    config = make_config("simclr_tiny", [
        f"data.source={colours}", "model.base_width=4", "train.batch_size=16", "train.steps=2",
        "train.eval_every=2", "train.checkpoint_every=2", "train.eval_batches=1",
        "train.progress=false", "examples.knn_bank_size=32"])
    Trainer(config, workdir).run()
    return str(workdir)


def test_subset_is_class_balanced_fixed_by_its_seed_and_differs_across_seeds():
    labels = np.repeat(np.arange(4), [500, 120, 37, 3])
    np.random.default_rng(1).shuffle(labels)
    for fraction in (0.01, 0.1):
        chosen = balanced_subset(labels, fraction, seed=0)
        assert len(set(chosen.tolist())) == len(chosen)
        for label, count in enumerate(np.bincount(labels)):
            assert abs(np.sum(labels[chosen] == label) - fraction * count) <= 1
        np.testing.assert_array_equal(chosen, balanced_subset(labels, fraction, seed=0))
        assert not np.array_equal(chosen, balanced_subset(labels, fraction, seed=1))
    assert (epochs_for(0.01), epochs_for(0.1)) == (60, 30)  # SimCLR B.5


def test_simclr_backbone_fine_tunes_resumes_exactly_and_evaluates(tmp_path, colours,
                                                                    simclr_run, capsys):
    config = finetune_config("semi", simclr_run, colours, FAST, epochs=3)
    optim = config.optim
    assert config.method == "semi" and config.model.architecture == simclr_run
    assert (optim.optimizer, optim.nesterov, optim.momentum, optim.weight_decay,
            optim.schedule, optim.warmup_steps) == ("sgd", True, 0.9, 0.0, "cosine", 0)
    # The start is the pre-trained backbone, its BatchNorm statistics too, under a zero head.
    start = Trainer(config, tmp_path / "probe").init_state()
    params = nnx.to_pure_dict(start.params)
    source = nnx.to_pure_dict(nnx.state(load_pretrained(simclr_run), nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, params["backbone"], source)
    assert not np.any(params["head"]["kernel"])
    statistics = nnx.to_pure_dict(nnx.state(load_pretrained(simclr_run), nnx.BatchStat))
    started = nnx.to_pure_dict(jax.device_get(start.model_state))["backbone"]
    trained = [(started_value, value) for started_value, value in zip(
        jax.tree.leaves(started), jax.tree.leaves(statistics), strict=True)]
    assert trained and any(np.any(value != np.round(value)) for _, value in trained)
    for started_value, value in trained:  # control: a fresh network's are all 0 and 1
        np.testing.assert_array_equal(started_value, value)
    # Interrupted and resumed == straight through, parameter for parameter.
    Trainer(config, tmp_path / "a").run(stop_after=7)
    resumed = finetune(config, tmp_path / "a")
    assert run.main(["finetune", "--task", "semi", "--init", simclr_run, "--data", colours,
                     "--workdir", str(tmp_path / "b"), "--epochs", "3", *FAST]) == 0
    assert re.search(r"semi dev after \d+ steps: top1 [0-9.]+ \(majority class [0-9.]+\)",
                     capsys.readouterr().out)
    straight = json.loads((tmp_path / "b" / RESULTS_FILE).read_text())
    assert resumed["dev"] == straight["dev"] and resumed["steps"] == config.train.steps
    jax.tree.map(np.testing.assert_array_equal,
                 *(nnx.to_pure_dict(nnx.state(load_model(tmp_path / r), nnx.Param))
                   for r in "ab"))
    assert evaluate(tmp_path / "a")["dev"] == resumed["dev"]
    listed = json.loads((tmp_path / "a" / SUBSET_FILE).read_text())
    labelled = len(listed["indices"])  # half of each class of the 160 training images
    assert labelled == sum(listed["per_class"]) and abs(labelled - 80) <= 3
    assert config.train.steps == 3 * math.ceil(labelled / 16)  # 3 epochs at batch 16
    # The colour decides the class: fine-tuning beats predicting the majority class.
    assert straight["dev"]["top1"] > straight["majority_baseline"]["top1"] + 0.2, straight


def test_random_start_copies_the_architecture_and_a_text_model_is_refused(
        tmp_path, colours, simclr_run, capsys):
    config = finetune_config("semi", "", colours, FAST, epochs=1, architecture=simclr_run)
    assert config.model.init == "" and config.model.architecture == simclr_run
    params = nnx.to_pure_dict(Trainer(config, tmp_path / "random").init_state().params)
    source = nnx.to_pure_dict(nnx.state(load_pretrained(simclr_run), nnx.Param))
    shapes = jax.tree.map(np.shape, params["backbone"])
    assert shapes == jax.tree.map(np.shape, source)
    kernels = [(a, b) for a, b in zip(jax.tree.leaves(params["backbone"]),
                                      jax.tree.leaves(source), strict=True) if np.ndim(a) == 4]
    assert kernels and not any(np.array_equal(a, b) for a, b in kernels)  # random, not trained
    bert = tmp_path / "bert"
    hf_reference("BertForPreTraining", 0, vocab_size=16, hidden_size=8, num_hidden_layers=1,
                 num_attention_heads=2, intermediate_size=16, max_position_embeddings=16,
                 type_vocab_size=2).save_pretrained(bert)
    (bert / "vocab.txt").write_text("\n".join(f"w{i}" for i in range(16)) + "\n")
    workdir = tmp_path / "text"
    capsys.readouterr()
    assert run.main(["finetune", "--task", "semi", "--init", str(bert), "--data", colours,
                     "--workdir", str(workdir)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not an image backbone" in err, err
    assert not workdir.exists()


IMAGE_PRESETS = ("simclr_tiny", "moco_tiny", "byol_tiny", "rotation_tiny", "jigsaw_tiny",
                 "context_tiny", "deepcluster_tiny", "cmc_tiny", "dim_tiny", "amdim_tiny",
                 "local_aggregation_tiny")


def test_every_image_methods_backbone_takes_the_head(tmp_path):
    """One downstream for all: each image method's `downstream_model()` (as its model.json
    records the network) under the linear layer gives logits per class (shapes traced only)."""
    for preset in IMAGE_PRESETS:
        config = make_config(preset, [])
        folder = tmp_path / preset
        folder.mkdir()
        (folder / "model.json").write_text(json.dumps(
            {"method": config.method, "model": dataclasses.asdict(config.model)}))
        model = nnx.eval_shape(lambda f=folder: build_semi(
            SemiModelConfig(architecture=str(f), num_classes=3), 0))
        graphdef, state = nnx.split(model)
        logits = jax.eval_shape(lambda s, g=graphdef: nnx.merge(g, s)(
            jax.numpy.zeros((2, 32, 32, 3)), train=False), state)
        assert logits.shape == (2, 3), preset


def test_simclr_v2_start_keeps_the_first_projection_layer(tmp_path, colours, simclr_run):
    config = finetune_config("semi", simclr_run, colours, [*FAST, "model.projection_layers=1"],
                             epochs=1)
    params = nnx.to_pure_dict(Trainer(config, tmp_path / "v2").init_state().params)
    source = load_model(simclr_run)  # the whole SimCLR network, projection head included
    jax.tree.map(np.testing.assert_array_equal, params["backbone"]["layers"][0],
                 nnx.to_pure_dict(nnx.state(source.head[0], nnx.Param)))
    assert params["head"]["kernel"].shape[0] == source.head[0].dense.kernel.shape[1]
    rotation = tmp_path / "rotation"
    rotation.mkdir()
    (rotation / "model.json").write_text(json.dumps(
        {"method": "rotation", "model": dataclasses.asdict(make_config("rotation_tiny").model)}))
    with pytest.raises(UserError, match="keeps no projection layers"):
        build_semi(SemiModelConfig(architecture=str(rotation), num_classes=3,
                                   projection_layers=1), 0)
    with pytest.raises(UserError, match="model.architecture is empty"):
        build_semi(SemiModelConfig(num_classes=3), 0)  # e.g. run.py pretrain --preset semi_...
