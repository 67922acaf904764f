"""Kills and preemption signals change nothing about image runs either: SimCLR on an image folder
(whole images) stopped as a kill stops it, and on a TFDS image dataset prepared on disk (images
of many sizes, cropped on the host) stopped with SIGTERM, then rerun, ends with the losses and
parameters of an uninterrupted run, bit for bit. The data position resumes because image
sources describe their content, not their object ids; other images are refused with the fact
that changed."""

from __future__ import annotations

import numpy as np
import pytest
from resilience_utils import (
    abort_and_resume,
    assert_same_training,
    run_in_process,
    stop_and_resume,
)
from tfds_utils import build_image_dataset

from pretext_jax.errors import UserError
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.trainer import Trainer

STEPS = 10
SIMCLR = {
    "model.depth": 10, "model.base_width": 4, "objective.image_size": 16, "train.batch_size": 8,
    "train.steps": STEPS,
    "train.log_every": 1, "train.eval_every": 1000, "train.eval_batches": 1,
    "train.checkpoint_every": 3, "train.progress": False, "optim.warmup_steps": 2,
    "data.held_out_fraction": 0.25,
}


def write_png_folder(root, count: int, seed: int = 0) -> None:
    """root/<class>/<i>.png: `count` random 16x16 RGB images per class, two classes."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for label in ("cat", "dog"):
        (root / label).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(
                root / label / f"{i}.png")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, dict]:
    """The data settings of each image source."""
    root = tmp_path_factory.mktemp("images")
    write_png_folder(root / "folder", 16)
    build_image_dataset(root / "tfds", "tiny_images", {"train": 32, "test": 8}, sizes=(12, 28))
    return {"image folder": {"data.source": str(root / "folder")},
            "TFDS images": {"data.source": "tfds:tiny_images",
                            "data.tfds_data_dir": str(root / "tfds"),
                            "examples.host_crop_size": 16}}


@pytest.mark.parametrize(("source", "stop", "step"), [("image folder", "kill", 5),
                                                      ("TFDS images", "SIGTERM", 8)])
def test_killed_or_stopped_image_run_equals_an_uninterrupted_one(source, stop, step, sources,
                                                                tmp_path):
    """A run is stopped as a kill stops it in place of step 5 (`abort_and_resume`: the last
    checkpoint is step 3's, so steps 4-5 are redone), or sent SIGTERM as step 8 begins
    (`stop_and_resume`: it finishes step 8, checkpoints it and returns, so the rerun starts
    mid-epoch at step 9); the rerun that finishes, and the reference, run in this process (its
    compilation cache is warm). tests/test_resilience.py sends SIGKILL and SIGTERM to text
    runs' worker processes: a signal's effect does not depend on the method, the resumed image
    data position is what this checks."""
    overrides = {**SIMCLR, **sources[source], "data.cache_dir": str(tmp_path / "cache")}
    reference = tmp_path / "reference", tmp_path / "reference.log"
    run_in_process("simclr_tiny", overrides, *reference)
    ours = (abort_and_resume if stop == "kill" else stop_and_resume)(
        "simclr_tiny", overrides, tmp_path, step=step)
    executed = assert_same_training("simclr_tiny", overrides, ours, reference)
    assert len(executed) > STEPS or stop == "SIGTERM"  # a kill loses steps, redone


def test_resuming_on_changed_images_names_what_changed(tmp_path):
    """The same settings over a folder whose images changed since the checkpoint: one line
    naming the fact that differs, nothing trained."""
    write_png_folder(tmp_path / "folder", 16)
    overrides = {**SIMCLR, "data.source": str(tmp_path / "folder"), "train.steps": 1,
                 "data.cache_dir": str(tmp_path / "cache")}
    Trainer(make_config("simclr_tiny", overrides), tmp_path / "w").run()
    write_png_folder(tmp_path / "folder" / "extra", 1)  # a third class: another image
    with pytest.raises(UserError, match=r"at step 1 .* other data records \(images: 24 vs 26\); "
                                        "restore that data or use a new --workdir"):
        Trainer(make_config("simclr_tiny", {**overrides, "train.steps": 2}), tmp_path / "w").run()


def test_an_unreadable_image_is_named_with_the_ways_to_go_on(tmp_path, capsys):
    """A broken file among the training images stops a fresh run naming the file and both ways
    on, and takes back the run's workdir; with `examples.skip_unreadable_images` a new run
    leaves it out, says so, and resumes after the file is removed (the same images)."""
    write_png_folder(tmp_path / "train", 8)
    write_png_folder(tmp_path / "val", 4, seed=1)
    broken = tmp_path / "train" / "dog" / "007.jpg"
    broken.write_bytes(b"not an image")
    overrides = {**SIMCLR, "data.source": str(tmp_path / "train"),
                 "data.eval_source": str(tmp_path / "val"), "train.steps": 6,
                 "train.checkpoint_every": 1000, "data.cache_dir": str(tmp_path / "cache")}
    with pytest.raises(UserError, match=rf"^{broken} is not a readable image \(not in a format "
                                        r"Pillow reads\); remove or re-encode it \(a run with "
                                        r"checkpoints then starts again in a new --workdir\), "
                                        "or start with examples.skip_unreadable_images=true"):
        Trainer(make_config("simclr_tiny", overrides), tmp_path / "w").run()
    assert not (tmp_path / "w").exists()
    skipping = {**overrides, "examples.skip_unreadable_images": True, "train.steps": 1,
                "train.checkpoint_every": 1}
    Trainer(make_config("simclr_tiny", skipping), tmp_path / "w").run()
    assert f"left out 1 unreadable image ({broken}; all listed in " in capsys.readouterr().out
    broken.unlink()
    summary = Trainer(make_config("simclr_tiny", {**skipping, "train.steps": 2}),
                      tmp_path / "w").run()
    assert summary["step"] == 2 and "resumed from step 1" in capsys.readouterr().out


def test_records_in_device_memory_train_as_the_host_loader_and_resume(sources, tmp_path):
    """`train.records_in_device_memory`: the host reads only record indices and the step
    gathers the images on the device: the same losses and parameters as the host loader's
    run, bit for bit, also when stopped at step 4 and resumed (its own data position: record
    indices). A method that lays out its records on the host (XLNet's consecutive batches) is
    refused."""
    from resilience_utils import flat_params, train_losses

    overrides = {**SIMCLR, **sources["image folder"], "train.steps": 6,
                 "data.cache_dir": str(tmp_path / "cache")}
    device = {**overrides, "train.records_in_device_memory": True}
    host = Trainer(make_config("simclr_tiny", overrides), tmp_path / "host").run()
    trainer = Trainer(make_config("simclr_tiny", device), tmp_path / "device")
    assert set(trainer.rows) == {"image", "label"} and len(trainer.rows["image"]) == 24
    assert trainer.run(stop_after=4)["step"] == 4
    resumed = Trainer(make_config("simclr_tiny", device), tmp_path / "device").run()
    assert train_losses(tmp_path / "host") == train_losses(tmp_path / "device")
    ours, theirs = (flat_params(run["state"].params) for run in (resumed, host))
    for key in theirs:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
    with pytest.raises(UserError, match="records_in_device_memory=true needs records fed as "
                                        "they are stored"):
        Trainer(make_config("xlnet_tiny", {"train.records_in_device_memory": True,
                                          "train.batch_size": 32, "train.steps": 1,
                                          "train.progress": False,
                                          "data.cache_dir": str(tmp_path / "cache")}),
                tmp_path / "xlnet")
