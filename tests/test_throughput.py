"""The throughput harness (bench/throughput.py) on CPU with the tiny workloads: it runs the
trainer's real step, its synthetic batches look like the loaders' batches, and its FLOP
formulas agree with XLA's own count of the compiled step."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tfds_utils import write_cifar10_folder

from bench import throughput
from pretext_jax.pretrain.trainer import Trainer

TINY_WORKLOADS = ["bert_tiny", "electra_tiny", "xlnet_tiny", "simclr_tiny"]


@pytest.fixture(scope="module")
def cifar_folder(tmp_path_factory):
    """A CIFAR-10-format folder of random images."""
    folder = tmp_path_factory.mktemp("cifar")
    rng = np.random.default_rng(0)
    write_cifar10_folder(folder, lambda: (
        rng.integers(0, 256, (16, 32, 32, 3), dtype=np.uint8), range(16)))
    return folder


@pytest.mark.parametrize("workload", TINY_WORKLOADS)
def test_harness_times_the_real_step(workload):
    result = throughput.measure(workload, steps=2, warmup=1)
    per_s = result.get("sequences_per_s") or result.get("images_per_s")
    assert per_s > 0 and result["steps_per_s"] > 0 and result["compile_s"] > 0
    assert result["model_tflop_per_step"] > 0 and np.isfinite(result["loss"])
    assert result["batch_size"] == throughput.WORKLOADS[workload].batch_size
    assert result["state_donated"] is True  # the step freed the state it was given


def test_cli_appends_json_lines(tmp_path, capsys):
    out, markdown = tmp_path / "results.jsonl", tmp_path / "rows.md"
    throughput.main(["--workload", "bert_tiny", "--workload", "bert_tiny", "--steps", "1",
                     "--warmup", "0", "--json", str(out), "--markdown", str(markdown),
                     "train.batch_size=16"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["batch_size"] for row in rows] == [16, 16]
    assert json.loads(capsys.readouterr().out.splitlines()[0])["workload"] == "bert_tiny"
    lines = markdown.read_text().splitlines()  # the header once, then a row per workload
    assert "\n".join(lines[:2]) == throughput.TABLE.header() and len(lines) == 4
    assert all(line.startswith("| bert_tiny (`bert_tiny`) | 16, float32 | ") for line in lines[2:])


@pytest.mark.parametrize("workload", TINY_WORKLOADS)
def test_synthetic_batches_have_the_loaders_layout(workload, tmp_path_factory, cifar_folder):
    """Keys, shapes and dtypes of a synthetic batch equal those of the method's data loader on
    real (prepared) data with the same config."""
    cache = tmp_path_factory.getbasetemp() / "throughput-data"
    source = [f"data.source={cifar_folder}"] if workload == "simclr_tiny" else \
        ["model.vocab_size=0", "data.vocab_size=1000"]
    config = throughput.workload_config(workload, [*source, f"data.cache_dir={cache}"])
    trainer = Trainer(config, tmp_path_factory.mktemp("workdir"))
    real = next(trainer.data_iterator())
    synthetic = throughput.synthetic_batch(
        throughput.workload_config(workload, [f"model.vocab_size={trainer.model_config.vocab_size}"]
                                   if workload != "simclr_tiny" else []))
    assert set(synthetic) == set(real)
    for key, value in real.items():
        assert (synthetic[key].shape, synthetic[key].dtype) == (value.shape, value.dtype), key


@pytest.mark.parametrize("workload", TINY_WORKLOADS)
def test_flop_formula_matches_xlas_count_of_the_step(workload):
    """The stated formula against XLA's cost analysis of the whole training step (layers
    unrolled, no remat) at a width where matrix products dominate, as on real models."""
    wide = ["model.hidden_size=256", "model.intermediate_size=1024", "model.num_heads=4",
            "model.scan_layers=false"]
    if workload == "electra_tiny":
        wide.append("model.embedding_size=128")
    config = throughput.workload_config(workload, [] if workload == "simclr_tiny" else wide)
    trainer = Trainer(config, "/nonexistent", data=throughput.synthetic_data(config))
    batch = throughput.synthetic_batch(config)
    lowered = trainer._train_step.lower(trainer.abstract_state, trainer.to_global(batch))
    counted = lowered.cost_analysis()["flops"]
    assert counted == pytest.approx(throughput.model_flops(config, batch, trainer), rel=0.12)


@pytest.mark.parametrize("workload", ["bert_tiny", "xlnet_tiny"])
def test_bfloat16_loss_curve_follows_the_float32_one(workload):
    """The bf16, scanned path and the plain float32 path from the same init on the same
    batches: both losses fall and stay within bf16 tolerance of each other."""
    curves = throughput.loss_curves(workload, ["model.dtype=bfloat16"], steps=30)
    assert curves["dtype"] == "bfloat16"
    for losses in (curves["optimised"], curves["plain_float32"]):
        assert losses[-1] < losses[0] - 0.5
    assert curves["max_relative_difference"] < 0.02
