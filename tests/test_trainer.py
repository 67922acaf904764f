"""The trainer on real (tiny) BERT and ELECTRA runs: sharding equivalence, param placement,
exact resume."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from parity_utils import encoder_pretraining

from pretext_jax.errors import UserError
from pretext_jax.models import migration
from pretext_jax.pretrain import directories, integrity, loading
from pretext_jax.pretrain.config import config_from_dict, make_config
from pretext_jax.pretrain.trainer import Trainer

TINY = {
    "model.hidden_size": 64, "model.num_layers": 2, "model.num_heads": 8,
    "model.intermediate_size": 128, "model.max_position_embeddings": 64,
    "model.hidden_dropout": 0.1, "model.attention_dropout": 0.1,  # exercise the dropout RNG
    "examples.max_seq_length": 32, "examples.max_predictions_per_seq": 5,
    "examples.dupe_factor": 1, "data.vocab_size": 1000,
    "train.batch_size": 16, "train.log_every": 1, "train.eval_every": 1000,
    "train.eval_batches": 1, "train.progress": False, "optim.warmup_steps": 2,
    "optim.learning_rate": 1e-3,
}


# ELECTRA has no NSP pairs (no dupe_factor); embedding_size != hidden exercises the projections.
ELECTRA_TINY = {**{k: v for k, v in TINY.items() if k != "examples.dupe_factor"},
                "model.embedding_size": 32}
# XLNet: memory of 24 carried between steps, records laid out for 16 streams.
XLNET_TINY = {
    **{k: v for k, v in TINY.items()
       if not k.startswith("examples.") and k != "model.max_position_embeddings"},
    "model.mem_len": 24, "model.reuse_len": 16, "examples.max_seq_length": 32,
    "examples.reuse_len": 16, "examples.perm_size": 16, "examples.num_predict": 5,
    "examples.num_streams": 16,
}
# SimCLR: a 4-wide ResNet-10 on a small CIFAR-format folder (written by the fixture below).
SIMCLR_TINY = {"model.depth": 10, "model.base_width": 4, "objective.image_size": 16,
               "train.batch_size": 16,
               "train.log_every": 1,
               "train.eval_every": 1000, "train.eval_batches": 1, "train.progress": False,
               "optim.warmup_steps": 2}
PRESET_OVERRIDES = {"bert_tiny": TINY, "electra_tiny": ELECTRA_TINY, "xlnet_tiny": XLNET_TINY,
                    "simclr_tiny": SIMCLR_TINY}


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    """One prepared copy of each corpus shared by every trainer in this module, and a small
    CIFAR-10-format folder (random images) for the image method."""
    cache = tmp_path_factory.mktemp("prepared")
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        rows = rng.integers(0, 256, (16, 3072), dtype=np.uint8)
        with (cache / name).open("wb") as f:
            pickle.dump({b"data": rows, b"labels": list(range(16))}, f)
    return str(cache)


def make_trainer(workdir, data_cache, mesh=(-1, 1, 1), devices=None, preset="bert_tiny",
                 **overrides):
    source = {"data.source": data_cache} if preset == "simclr_tiny" else {}
    values = {**PRESET_OVERRIDES[preset], **source, "data.cache_dir": data_cache,
              "mesh.data": mesh[0], "mesh.fsdp": mesh[1], "mesh.tensor": mesh[2], **overrides}
    return Trainer(make_config(preset, values), workdir, devices=devices)


def first_batch(trainer):
    return next(trainer.data_iterator())


def flat_params(state):
    """Parameters and model state (XLNet's memory) by path, on the host."""
    tree = {"params": state.params, "model_state": state.model_state}
    return {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(jax.device_get(tree))}


@pytest.mark.parametrize("preset", ["bert_tiny", "electra_tiny", "xlnet_tiny", "simclr_tiny"])
def test_same_step_on_every_mesh(tmp_path, data_cache, preset):
    """One step (dropout on; ELECTRA also samples, SimCLR augments and updates BatchNorm
    statistics) gives the same loss, params and model state on 1 device and on the (2, 2, 2)
    mesh, and for BERT also on (1, 1, 8) and (8, 1, 1). The mixed mesh already shards each
    method's batch 4 ways and its parameters over fsdp and tensor by the same rules; BERT's
    extra meshes add the cases it leaves out (dimensions that 8 does not divide, which the
    rules replicate; no parameter sharding at all), which depend on the rules, not the method."""
    results = {}
    layouts = {"single": ((1, 1, 1), jax.devices()[:1]), "mixed": ((2, 2, 2), None)} | (
        {"tp": ((1, 1, 8), None), "dp": ((8, 1, 1), None)} if preset == "bert_tiny" else {})
    batch = None
    for name, (mesh, devices) in layouts.items():
        trainer = make_trainer(tmp_path / name, data_cache, mesh=mesh, devices=devices,
                               preset=preset)
        batch = first_batch(trainer) if batch is None else batch
        state, metrics = trainer.train_step(trainer.init_state(), batch)
        results[name] = (float(metrics["loss"][0]), flat_params(state))
    loss0, params0 = results["single"]
    assert np.isfinite(loss0)
    for name, (loss, params) in results.items():
        assert loss == pytest.approx(loss0, rel=1e-6, abs=1e-5), name
        for key, value in params0.items():
            np.testing.assert_allclose(params[key], value, atol=2e-6, rtol=1e-5,
                                       err_msg=f"{name} {key}")


def test_params_are_sharded_as_the_rules_say(tmp_path, data_cache):
    trainer = make_trainer(tmp_path / "w", data_cache, mesh=(2, 2, 2))
    state = trainer.init_state()
    layers = state.params["encoder"]["stack"]["layers"]
    intermediate = layers["intermediate"]["kernel"][...]
    assert intermediate.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    shard = intermediate.addressable_shards[0].data
    assert shard.shape == (2, 32, 64)  # [layers, embed/fsdp, mlp/tensor]
    words = state.params["encoder"]["embeddings"]["word_embeddings"]["embedding"][...]
    assert words.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
    norm = layers["output_layer_norm"]["scale"][...]
    assert norm.sharding.spec == jax.sharding.PartitionSpec(None, None)
    # Adam moments follow their parameters.
    moments = jax.tree.leaves(state.opt_state)
    assert any(getattr(m, "sharding", None) == intermediate.sharding for m in moments
               if getattr(m, "shape", None) == intermediate.shape)


def test_gradient_accumulation_matches_one_big_batch(tmp_path, data_cache):
    """Two micro-batches of 8 give the same update as one batch of 16 (dropout off)."""
    no_dropout = {"model.hidden_dropout": 0.0, "model.attention_dropout": 0.0}
    plain = make_trainer(tmp_path / "a", data_cache, **no_dropout)
    accum = make_trainer(tmp_path / "b", data_cache, **no_dropout,
                         **{"optim.grad_accum_steps": 2})
    batch = first_batch(plain)
    state_a, metrics_a = plain.train_step(plain.init_state(), batch)
    state_b, metrics_b = accum.train_step(accum.init_state(), batch)
    a, b = flat_params(state_a), flat_params(state_b)
    for key in a:
        np.testing.assert_allclose(b[key], a[key], atol=2e-6, rtol=1e-5, err_msg=key)
    ratio = metrics_b["mlm_accuracy"][0] / metrics_b["mlm_accuracy"][1]
    assert ratio == pytest.approx(metrics_a["mlm_accuracy"][0] / metrics_a["mlm_accuracy"][1])


def read_losses(workdir):
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["split"] == "train"}


@pytest.mark.parametrize("preset", ["bert_tiny", "electra_tiny", "xlnet_tiny"])
def test_resume_is_exact(tmp_path, data_cache, preset):
    """6 steps straight == 3 steps, restart from the checkpoint, 3 more; same data stream
    (for ELECTRA also the same masks and generator samples, for XLNet the same orders and the
    recurrence memory, which is checkpointed with the state), also from a workdir saved
    before a config field was added. For BERT and ELECTRA (the models whose MLM head had other
    names), a copy of the stopped workdir whose checkpoint names the head's parameters as
    before (`mlm_transform`, `mlm_layer_norm`, `mlm_bias`, in the parameters and the optimizer
    moments) loads as the same model, restores to the same train state and resumes to the same
    losses and parameters."""
    settings = {"train.steps": 6, "train.checkpoint_every": 3}
    straight = make_trainer(tmp_path / "straight", data_cache, preset=preset, **settings).run()
    interrupted = tmp_path / "resumed"
    first = make_trainer(interrupted, data_cache, preset=preset, **settings).run(stop_after=3)
    assert first["step"] == 3
    # A workdir written before a config field existed resumes with that field's default.
    saved = json.loads((interrupted / "config.json").read_text())
    del saved["optim"]["layerwise_lr_decay"]
    (interrupted / "config.json").write_text(json.dumps(saved))
    resumed_runs = {interrupted: None}
    if preset != "xlnet_tiny":
        resumed_runs[with_old_parameter_names(interrupted, tmp_path / "old", step=3)] = None
    for workdir in resumed_runs:
        trainer = make_trainer(workdir, data_cache, preset=preset, **settings)
        resumed_runs[workdir] = (trainer, trainer.run())
    resumed_trainer, resumed = resumed_runs[interrupted]
    assert resumed["step"] == 6
    a = flat_opt_and_params(straight["state"])
    for workdir, (_, summary) in resumed_runs.items():
        assert read_losses(workdir) == read_losses(tmp_path / "straight"), workdir
        b = flat_opt_and_params(summary["state"])
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"{workdir.name} {key}")
    # The data stream continued where it stopped: batch 4 of a fresh stream is the next batch.
    fresh = resumed_trainer.data_iterator()
    expected = [next(fresh) for _ in range(4)][-1]
    _, saved = resumed_trainer.checkpoints.restore(3)
    resumed_trainer.checkpoints.close()
    continued = resumed_trainer.data_iterator()
    continued.set_state(saved["iterators"][0].encode())
    got = next(continued)
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key])


def with_old_parameter_names(workdir: Path, copy: Path, step: int) -> Path:
    """A copy of `workdir` whose checkpoint `step` holds the parameters (and their moments)
    under the names of before `models.migration`'s renames; it loads as the same model and
    restores to the same train state as `workdir` (asserted)."""
    shutil.copytree(workdir, copy)
    state_dir = copy / "checkpoints" / str(step) / "state"
    old_names = with_old_names(loading.restore_on_one_device(state_dir))
    assert migration.has_old_names(old_names)
    shutil.rmtree(state_dir)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(state_dir.resolve(), old_names)
    checkpointer.wait_until_finished()
    integrity.seal(copy / "checkpoints" / str(step))
    assert migration.has_old_names(directories.saved_layout(state_dir))
    loaded = [nnx.to_pure_dict(nnx.state(loading.load_model(w), nnx.Param))
              for w in (workdir, copy)]
    jax.tree.map(np.testing.assert_array_equal, loaded[0], loaded[1])
    config = config_from_dict(json.loads((workdir / "config.json").read_text()))
    restored = []
    for folder in (workdir, copy):
        trainer = Trainer(config, folder)
        restored.append(flat_opt_and_params(trainer.checkpoints.restore(step)[0]))
        trainer.checkpoints.close()
    assert restored[0].keys() == restored[1].keys()
    for key in restored[0]:
        np.testing.assert_array_equal(restored[0][key], restored[1][key], err_msg=key)
    return copy


def old_layout(config: dict) -> dict:
    """A config dict as written before the `objective` section: its keys under `model`."""
    config = dict(config)
    config["model"] = {**config["model"], **config.pop("objective")}
    return config


def test_workdir_of_the_old_config_layout_loads_and_resumes(tmp_path, data_cache):
    """A workdir whose config.json and checkpoint hold the loss settings under `model` (written
    before the `objective` section existed) reads into today's layout and resumes; a
    checkpoint of other loss settings in that layout is still refused, naming the key."""
    settings = {"train.steps": 2, "train.checkpoint_every": 1,
                "objective.discriminator_weight": 40.0}
    workdir = tmp_path / "w"
    first = make_trainer(workdir, data_cache, preset="electra_tiny", **settings)
    first.run(stop_after=1)
    new = json.loads((workdir / "config.json").read_text())
    preset = make_config("electra_tiny").to_dict()["objective"]
    assert new["objective"] == {**preset, "discriminator_weight": 40.0} != preset
    old = old_layout(new)
    assert old["model"]["discriminator_weight"] == 40.0 and "objective" not in old
    assert config_from_dict(old) == first.config  # config.json read in the new layout
    (workdir / "config.json").write_text(json.dumps(old))
    stored = workdir / "checkpoints" / "1" / "config" / "metadata"  # Orbax's JSON item
    assert json.loads(stored.read_text()) == new
    stored.write_text(json.dumps(old))  # the checkpoint's own copy, in the old layout
    integrity.seal(workdir / "checkpoints" / "1")  # as if written so, not damaged
    resumed = make_trainer(workdir, data_cache, preset="electra_tiny", **settings)
    resumed.checkpoints.restore(1)  # compares the checkpoint's config with this run's first
    resumed.checkpoints.close()
    assert resumed.run()["step"] == 2
    other = {**settings, "objective.discriminator_weight": 50.0, "train.steps": 3}
    (workdir / "config.json").write_text(json.dumps(old))
    with pytest.raises(UserError, match=r"another config \(objective.discriminator_weight: "
                                        r"40.0 vs 50.0\)"):
        make_trainer(workdir, data_cache, preset="electra_tiny", **other)


VIEW_KEYS = ("image_size", "crop_area_min", "jitter_strength", "blur_probability")


def test_simclr_workdir_with_view_settings_under_model_loads_and_resumes(tmp_path, data_cache):
    """A SimCLR workdir written while the views' augmentation settings were model settings
    (`model.image_size`, `model.jitter_strength`, ... in config.json, the checkpoint's config
    and model.json; the temperature already under `objective`) reads into today's layout, its
    model loads, and it resumes; so does the layout with every loss setting under `model`."""
    from pretext_jax.pretrain.loading import load_model

    settings = {"train.steps": 2, "train.checkpoint_every": 1,
                "objective.jitter_strength": 0.25}
    workdir = tmp_path / "w"
    first = make_trainer(workdir, data_cache, preset="simclr_tiny", **settings)
    first.run(stop_after=1)
    new = json.loads((workdir / "config.json").read_text())
    assert (new["objective"]["image_size"], new["objective"]["jitter_strength"]) == (16, 0.25)
    assert not set(VIEW_KEYS) & set(new["model"])
    views = {k: v for k, v in new["objective"].items() if k in VIEW_KEYS}
    old = {**new, "model": {**new["model"], **views},
           "objective": {k: v for k, v in new["objective"].items() if k not in VIEW_KEYS}}
    assert (old["model"]["image_size"], old["model"]["jitter_strength"]) == (16, 0.25)
    assert old["objective"]["temperature"] == 0.5 and not set(VIEW_KEYS) & set(old["objective"])
    assert config_from_dict(old) == config_from_dict(old_layout(new)) == first.config
    (workdir / "config.json").write_text(json.dumps(old))
    stored = workdir / "checkpoints" / "1" / "config" / "metadata"  # Orbax's JSON item
    assert json.loads(stored.read_text()) == new
    stored.write_text(json.dumps(old))  # the checkpoint's own copy, in the old layout
    integrity.seal(workdir / "checkpoints" / "1")  # as if written so, not damaged
    model_json = workdir / "model.json"
    info = json.loads(model_json.read_text())
    assert info["objective"]["image_size"] == 16 and "image_size" not in info["model"]
    model_json.write_text(json.dumps({"method": "simclr",
                                      "model": {**info["model"], **info["objective"]}}))
    assert type(load_model(workdir)).__name__ == "SimCLR"
    resumed = make_trainer(workdir, data_cache, preset="simclr_tiny", **settings)
    resumed.checkpoints.restore(1)  # compares the checkpoint's config with this run's first
    resumed.checkpoints.close()
    assert resumed.run()["step"] == 2
    with pytest.raises(UserError, match="model.image_size moved to the objective section; "
                                        "write objective.image_size=24"):
        make_config("simclr_tiny", ["model.image_size=24"])


def test_checkpoint_of_other_records_is_refused_with_a_clear_error(tmp_path, data_cache):
    """The checkpoint's data position belongs to other records (here: its description of them
    is edited): the error names the fact that differs."""
    trainer = make_trainer(tmp_path / "w", data_cache, **{"train.steps": 2})
    trainer.run()
    records = f"{trainer.data.train.directory.parent.name}/train"
    (metadata,) = (tmp_path / "w" / "checkpoints" / "2" / "data").glob("metadata")
    text = metadata.read_text()
    assert records in text
    metadata.write_text(text.replace(records, "0" + records))
    integrity.seal(tmp_path / "w" / "checkpoints" / "2")  # as if written so, not damaged
    with pytest.raises(UserError, match=rf"other data records \(records: '0{records}' vs "
                                        rf"'{records}'\); restore that data or use a new"):
        make_trainer(tmp_path / "w", data_cache, **{"train.steps": 3}).run()


def test_model_is_restored_from_workdir(tmp_path, data_cache):
    from pretext_jax.pretrain.loading import load_model

    summary = make_trainer(tmp_path / "w", data_cache, **{"train.steps": 2}).run()
    model = load_model(tmp_path / "w")
    restored = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    trained = nnx.to_pure_dict(jax.device_get(summary["state"].params))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(trained),
                            jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))
    # A process with one device (a plain shell) loads the workdir written on 8.
    script = ("import sys, jax, numpy as np; from flax import nnx; "
              "from pretext_jax.pretrain.loading import load_model; m = load_model(sys.argv[1]); "
              "print(len(jax.devices()), "
              "sum(float(np.abs(np.asarray(v)).sum()) for v in "
              "jax.tree.leaves(nnx.state(m, nnx.Param))))")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "w")], env=env,
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1],
                         check=True).stdout.split()
    expected = sum(float(np.abs(np.asarray(v)).sum()) for v in jax.tree.leaves(restored))
    assert out[0] == "1" and float(out[1]) == pytest.approx(expected, rel=1e-6)


def with_old_names(tree):
    """A restored tree (nested dicts and lists) in the layout of before `models.migration`'s
    renames: `lm_head.dense` -> `mlm_transform`, ... (for BERT and ELECTRA's generator, the
    models that had those names)."""
    if isinstance(tree, list | tuple):
        return [with_old_names(value) for value in tree]
    if not isinstance(tree, dict):
        return tree
    renamed = {key: with_old_names(value) for key, value in tree.items()}
    for old, (parent, name) in migration.RENAMED.items():
        if isinstance(renamed.get(parent), dict) and name in renamed[parent]:
            renamed[old] = renamed[parent].pop(name)
            if not renamed[parent]:
                del renamed[parent]
    return renamed


def flat_opt_and_params(state):
    """Every leaf of a train state (step, parameters, model state, optimizer state) by path."""
    return {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(jax.device_get(state))}


def test_convert_workdir_to_hf_and_back(tmp_path, data_cache):
    """`run.py convert` both ways: a trained workdir -> HF folder that transformers loads with
    the same outputs -> pretext model directory with the same parameters."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from pretext_jax import run
    from pretext_jax.pretrain.loading import load_model

    make_trainer(tmp_path / "w", data_cache, **{"train.steps": 1}).run()
    assert run.main(["convert", str(tmp_path / "w"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    ours = load_model(tmp_path / "w")
    reference = transformers.BertForPreTraining.from_pretrained(tmp_path / "hf").eval()
    ids = np.arange(24).reshape(2, 12) % ours.config.vocab_size
    encoder_pretraining("BertForPreTraining").assert_parity(ours, reference, ids,
                                                            np.zeros_like(ids), np.ones_like(ids))
    assert run.main(["convert", str(tmp_path / "hf"), str(tmp_path / "back"), "--to",
                     "pretext"]) == 0
    back = nnx.to_pure_dict(nnx.state(load_model(tmp_path / "back"), nnx.Param))
    for a, b in zip(jax.tree.leaves(back),
                    jax.tree.leaves(nnx.to_pure_dict(nnx.state(ours, nnx.Param))), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_dynamic_masking_stream_is_reproducible_and_trains(tmp_path, data_cache):
    """Masks are drawn while loading (Grain's per-record RNG): two streams agree, and the
    trainer runs on them."""
    trainer = make_trainer(tmp_path / "w", data_cache, **{"examples.dynamic_masking": True,
                                                          "train.steps": 2})
    first, second = trainer.data_iterator(), trainer.data_iterator()
    for _ in range(3):
        a, b = next(first), next(second)
        assert set(a) >= {"masked_lm_positions", "masked_lm_ids", "masked_lm_weights"}
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    assert a["masked_lm_weights"].sum() > 0
    summary = trainer.run()
    assert np.isfinite(summary["train"]["loss"]) and summary["step"] == 2


def test_simclr_evaluation_reports_the_knn_monitor(tmp_path, data_cache):
    """The kNN monitor runs at evaluation; the workdir's model comes back with its trained
    BatchNorm statistics (model state, not parameters), also through a model directory."""
    from pretext_jax.pretrain.export import save_model
    from pretext_jax.pretrain.loading import load_model

    summary = make_trainer(tmp_path / "w", data_cache, preset="simclr_tiny",
                           **{"train.steps": 1, "train.eval_every": 1}).run()
    assert 0.0 <= summary["eval"]["knn_accuracy"] <= 1.0
    assert summary["eval"]["contrastive_loss"] > 0
    assert not (tmp_path / "w" / "tokenizer").exists()  # images: no tokenizer to record
    trained = jax.tree.leaves(jax.device_get(summary["state"].model_state))
    model = load_model(tmp_path / "w")
    restored = jax.tree.leaves(nnx.state(model, nnx.BatchStat))
    assert len(restored) == len(trained) > 0
    for a, b in zip(trained, restored, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    copy = load_model(save_model(model, "simclr", tmp_path / "model"))
    for a, b in zip(restored, jax.tree.leaves(nnx.state(copy, nnx.BatchStat)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_simclr_on_an_image_folder_with_host_crops(tmp_path, data_cache):
    """Images of many sizes: the host sends two crops per image ([B, 2, S, S, 3]); the sharded
    step trains on them, and the kNN monitor votes with centre crops."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, count in (("train", 12), ("val", 4)):
        for label in ("a", "b"):
            for i in range(count):
                size = (int(rng.integers(20, 40)), int(rng.integers(20, 40)))
                folder = tmp_path / "images" / split / label
                folder.mkdir(parents=True, exist_ok=True)
                Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(
                    folder / f"{i}.jpg")
    trainer = make_trainer(tmp_path / "w", data_cache, preset="simclr_tiny", mesh=(4, 2, 1),
                           **{"data.source": str(tmp_path / "images"), "objective.image_size": 16,
                              "examples.host_crop_size": 16, "train.steps": 2,
                              "train.eval_every": 2, "train.batch_size": 8})
    assert first_batch(trainer)["image"].shape == (8, 2, 16, 16, 3)
    summary = trainer.run()
    assert np.isfinite(summary["train"]["loss"]) and 0 <= summary["eval"]["knn_accuracy"] <= 1


def test_simclr_imagenet_preset_is_the_papers_recipe():
    config = make_config("simclr_imagenet", [])
    assert (config.model.depth, config.train.batch_size, config.objective.temperature) == (
        50, 4096, 0.1)
    assert config.optim.learning_rate == 0.3 * 4096 / 256
    with pytest.raises(Exception, match="host_crop_size"):
        make_config("simclr_imagenet", ["examples.host_crop_size=192"])
