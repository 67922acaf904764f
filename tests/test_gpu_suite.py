"""bench/gpu_suite.py on CPU: its smoke mode in a subprocess, as the GPU machine runs it (a
JSON line per workload, an error line for a failing one while the others go on, the Markdown
table), and its budget, time boxes, error lines and ratio table without JAX."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_suite, profile_step, throughput

REPO = Path(__file__).resolve().parent.parent
# One CPU device and XLA's quick CPU code generation: the smoke checks that each workload
# compiles and steps, not how fast; the compilation cache makes a second run quicker.
SMOKE_ENV = {"JAX_PLATFORMS": "cpu",
             "XLA_FLAGS": "--xla_backend_optimization_level=0 "
                          "--xla_llvm_disable_expensive_passes=true",
             "JAX_COMPILATION_CACHE_DIR": os.path.expanduser("~/.cache/pretext-jax-gpu-suite"),
             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def read_results(out: Path) -> dict[str, dict]:
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return {line["part"]: line for line in lines}


# The subprocess smoke run steps a text workload of each example builder (masked LM, XLNet's
# permutations) and the image one on device crops; ELECTRA-base (BERT's batches) and the
# ResNet-50 SimCLR (the ResNet-18 one's batches, host crops) are traced and lowered at their
# smoke sizes in `test_smoke_sizes_...` instead: compiling them cost ~40 s of a cold CPU run.
SMOKE_RUN = ("bert_base", "xlnet_base", "simclr_cifar")


def test_smoke_mode_runs_its_workloads_and_goes_on_after_a_failing_one(tmp_path):
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    workloads = [SMOKE_RUN[0], "no_such_workload", *SMOKE_RUN[1:]]
    env = {key: value for key, value in os.environ.items() if key != "OUT"} | SMOKE_ENV
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_suite", "smoke", "--out", str(out), "--scratch",
         str(scratch), "--workloads", *workloads], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results = read_results(out)
    assert results["install"]["status"] == "ok"
    environment = results["environment"]
    assert environment["status"] == "ok" and environment["backend"] == "cpu"
    assert environment["pretext_jax"] == str(scratch / "shim" / "pretext_jax")
    for name in SMOKE_RUN:
        line = results[f"smoke:{name}"]
        assert line["status"] == "ok", line
        assert line["dtype"] == "bfloat16" and math.isfinite(line["loss"])
        assert line["state_donated"] is True and "peak_memory_gib" not in line
    failed = results["smoke:no_such_workload"]
    assert failed["status"] == "error" and "unknown workload 'no_such_workload'" in failed["error"]
    for check in ("cudnn_attention", "bf16_loss_curve"):
        assert results[f"smoke:{check}"]["status"] == "skipped"
    summary = (out / "summary.md").read_text()
    assert gpu_suite.SMOKE_TABLE.header() in summary
    rows = [line for line in summary.splitlines() if line.startswith("| ")][2:]
    assert [row.split(" | ")[0][2:] for row in rows] == [
        *workloads, "cudnn_attention", "bf16_loss_curve"]
    assert done.stdout.rstrip().endswith(rows[-1])  # printed last, where the reply's tail is
    assert "smoke:bert_base" in (out / "suite.log").read_text()


def test_profile_mode_names_where_the_step_spends_its_time(tmp_path):
    """`profile` (bench.profile_step through the suite): a traced tiny BERT step on CPU, its
    kernels summed per step by kind, the matrix products among them, each top kernel named by
    its JAX operation; the markdown and the raw trace land in the output folder."""
    out = tmp_path / "out"
    env = {key: value for key, value in os.environ.items() if key != "OUT"} | SMOKE_ENV
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_suite", "profile", "--out", str(out), "--scratch",
         str(tmp_path / "scratch"), "--workloads", "bert_tiny", "--budget", "300"], cwd=REPO,
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    line = read_results(out)["profile:bert_tiny"]
    assert line["status"] == "ok" and line["steps"] == 4, line
    assert sum(line["kinds"].values()) == pytest.approx(line["step_kernel_ms"], rel=1e-6)
    assert line["kinds"]["matrix product"] > 0, line["kinds"]
    text = (out / "profile_bert_tiny.md").read_text()
    assert "| kind | ms per step | share |" in text and "jit(_step)/" in text
    assert (out / "profile_bert_tiny.trace.json.gz").stat().st_size > 0


def test_smoke_sizes_are_valid_configs_of_the_throughput_workloads():
    """Each smoke size resolves; the workloads the smoke run leaves out build their trainer on
    synthetic batches and trace and lower their step (no compiling)."""
    assert set(gpu_suite.THROUGHPUT) <= set(throughput.WORKLOADS)
    assert set(gpu_suite.SMOKE_SIZES) == set(gpu_suite.THROUGHPUT)
    for name, overrides in gpu_suite.SMOKE_SIZES.items():
        config = throughput.workload_config(name, list(overrides))
        assert config.train.batch_size == 8
        assert config.model.dtype == throughput.workload_config(name).model.dtype
        if name not in SMOKE_RUN:
            trainer, (batch,) = throughput.trainer_and_batches(config, 1)
            lowered = trainer._train_step.lower(trainer.abstract_state, batch)
            assert lowered.cost_analysis()["flops"] > 0, name
    cudnn = throughput.workload_config("bert_base", [
        *gpu_suite.SMOKE_SIZES["bert_base"], *gpu_suite.NO_DROPOUT,
        "model.attention_implementation=cudnn"])
    assert cudnn.model.attention_implementation == "cudnn"
    measured = {w for reference in gpu_suite.TORCH_REFERENCES.values()
                for w in reference.workloads.values()}
    assert measured == set(gpu_suite.THROUGHPUT)


def test_time_box_keeps_the_reserved_floor_and_says_why_it_skips():
    roofline = gpu_suite.Part("roofline", 40, 20, reserved=True)
    torch = gpu_suite.Part("torch:bert", 150, 60)
    assert gpu_suite.time_box(torch, 500, [roofline]) == (150, "")
    assert gpu_suite.time_box(torch, 100, [roofline]) == (80, "")
    box, reason = gpu_suite.time_box(torch, 70, [roofline])
    assert box is None
    assert reason == "70 s of the budget left, 20 s of it kept for roofline; torch:bert needs " \
                     "at least 60 s"
    assert gpu_suite.time_box(roofline, 30, []) == (30, "")
    plan = gpu_suite.run_plan(gpu_suite.THROUGHPUT, ["bert"])
    assert [p.name for p in plan][:3] == ["environment", "smoke", "throughput:bert_base"]
    assert plan[-1].reserved and plan[-1].name == "roofline"


def test_parts_that_fail_time_out_or_do_not_fit_write_their_lines(tmp_path):
    suite = gpu_suite.Suite(tmp_path, budget_s=30, command="test")
    python = sys.executable
    keep = gpu_suite.plain_record("printer", "value")
    suite.run_part(gpu_suite.Part("printer", 20, 1), [], [python, "-c", (
        "print('{\"value\": 1.5}'); print('not json'); import sys; sys.exit(3)")], keep)
    suite.run_part(gpu_suite.Part("sleeper", 3, 1), [], [python, "-c", (
        "print('started', flush=True); import time; time.sleep(60)")], keep, grace_s=1)
    suite.run_part(gpu_suite.Part("too_big", 100, 60), [], [python, "-c", "pass"], keep)
    suite.close()
    lines = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(line["part"], line["status"]) for line in lines] == [
        ("printer", "ok"), ("printer", "error"), ("sleeper", "timeout"), ("too_big", "skipped")]
    assert lines[0]["value"] == 1.5 and lines[1]["returncode"] == 3
    assert "started" in lines[2]["tail"] and lines[2]["seconds"] < 10
    assert "too_big needs at least 60 s" in lines[3]["reason"]


def test_summary_has_the_ratio_to_torch_and_lists_what_did_not_run():
    records = [
        {"part": "environment", "status": "ok", "device_count": 1, "device_kind": "NVIDIA H100",
         "jax": "0.11.2"},
        {"part": "throughput:bert_base", "status": "ok", "sequences_per_s": 5000.0,
         "reference_per_s": 3747.0, "mfu": 0.4, "compile_s": 20.0, "peak_memory_gib": 9.5,
         "state_donated": True},
        {"part": "torch:bert", "status": "ok", "model": "hf-bert-base", "compile": False,
         "seq_per_s": 2500.0},
        {"part": "torch:bert", "status": "ok", "model": "hf-bert-base", "compile": True,
         "seq_per_s": 4000.0},
        {"part": "throughput:xlnet_base", "status": "timeout", "error": "stopped at 75 s"},
        {"part": "torch:xlnet", "status": "skipped", "reason": "10 s of the budget left"},
        {"part": "roofline", "status": "ok", "what": "jax bf16 matmul 8192^3", "tflops": 790.5},
    ]
    text = gpu_suite.summary_markdown(records, ["bert_base", "xlnet_base"], "cmd",
                                      gpu_suite.machine_cell(records))
    assert gpu_suite.RATIO_TABLE.header() in text
    bert = next(line for line in text.splitlines() if line.startswith("| bert_base |"))
    assert "| 5,000 | 2,500 | 4,000 | 1.25 | 3,747 | 1.33 | 0.400 | 20.0 | 9.5 | True | ok |" \
        in bert and "1 x NVIDIA H100, jax 0.11.2" in bert
    xlnet = next(line for line in text.splitlines() if line.startswith("| xlnet_base |"))
    assert "| timeout |" in xlnet
    assert "- torch:xlnet: skipped: 10 s of the budget left" in text
    assert "- jax bf16 matmul 8192^3: tflops 790.5" in text


def test_bad_overrides_and_missing_cifar10_files_get_one_line(tmp_path):
    with pytest.raises(SystemExit, match="write WORKLOAD:section.key=value"):
        gpu_suite.workload_overrides(["model.dtype=float32"])
    assert gpu_suite.workload_overrides(["bert_base:a.b=1", "bert_base:c.d=2"]) == {
        "bert_base": ["a.b=1", "c.d=2"]}
    part = tmp_path / "part3"
    part.mkdir()
    for name in ("data_batch_5", "test_batch", "batches.meta"):
        (part / name).write_bytes(b"x")
    gpu_suite.stage_cifar10(part, tmp_path / "data")
    assert gpu_suite.missing_cifar10_files(tmp_path / "data" / "cifar10") == [
        f"data_batch_{i}" for i in range(1, 5)]
    with pytest.raises(SystemExit, match="is not a folder"):
        gpu_suite.stage_cifar10(tmp_path / "part9", tmp_path / "data")


def test_semi_mode_needs_the_staged_data_and_a_pretraining_run(tmp_path):
    """`semi` records one error line (naming what to run first) when CIFAR-10 is not staged or
    `--init` holds no run, and the summary shows a finished fraction's row."""
    suite = gpu_suite.Suite(tmp_path / "out", 60, "python -m bench.gpu_suite semi")
    args = gpu_suite.parser().parse_args(["semi", "--data", str(tmp_path / "data"),
                                          "--scratch", str(tmp_path / "scratch")])
    gpu_suite.run_semi(suite, args)
    assert suite.records[-1]["status"] == "error"
    assert "lacks data_batch_1" in suite.records[-1]["error"]
    (tmp_path / "data" / "cifar10").mkdir(parents=True)
    for name in gpu_suite.missing_cifar10_files(tmp_path / "data" / "cifar10"):
        (tmp_path / "data" / "cifar10" / name).write_bytes(b"x")
    gpu_suite.run_semi(suite, args)
    assert "holds no pre-training run; run `cifar10 --method simclr`" in suite.records[-1]["error"]
    row = {"part": "semi:0.01", "status": "ok", "top1_pretrained": 0.5,
           "top1_random_init": 0.3, "majority_class": 0.1, "label_fraction": 0.01,
           "steps": 120, "batch_size": 256, "note": "lossy"}
    summary = gpu_suite.summary_markdown([row], [], "cmd", "H200")
    assert "top-1 0.5000 from the pre-trained backbone, 0.3000 from its random" in summary
    suite.close()


def test_unnamed_kernel_shaped_fusions_are_convolution_weight_gradients():
    """XLA:CPU's `ynn_fusion` computing a convolution's weight gradient has no `op_name`: its
    output of a kernel's shape ([out, k, k, in]) names it. Controls: the same output with an
    op name is a matrix product by that name; an unnamed fusion of another shape stays other."""
    hlo = ("  %ynn_fusion.3 = f32[64,3,3,32]{3,2,1,0} fusion(%a, %b), kind=kCustom\n"
           "  ROOT %ynn_fusion.4 = f32[8,64]{1,0} fusion(%c), kind=kCustom\n")
    dims = profile_step.output_dims(hlo)
    assert dims == {"ynn_fusion_3": (64, 3, 3, 32), "ynn_fusion_4": (8, 64)}
    summary = profile_step.summarize({"ynn_fusion.3": (4000.0, 2), "ynn_fusion.4": (2000.0, 2)},
                                     2, {}, dims=dims)
    assert summary["kinds"] == {profile_step.WEIGHT_GRADIENT: 2.0, "other fusion": 1.0}
    assert profile_step.kind_of("ynn_fusion.3", "jit(_step)/conv_general_dilated",
                                (64, 3, 3, 32)) == "matrix product"
