"""Training-step throughput of pretext's own trainer step, for comparison with HF transformers.

    python -m bench.throughput --workload bert_base [--steps 20] [--json out.json] [key=value ...]

A workload is a preset plus the batch and settings of a reference figure (../shared/bench
torch_text.py / torch_vision.py). The step timed is `Trainer.train_step`'s compiled function
(sharded state, donation, the method's loss, the optimizer update) on well-formed synthetic
batches made by the method's own example code (masking, permutation sampling) from random
token ids or pixels, already on the device: the figure is the device step, not the host input
pipeline. Prints one JSON object: compile seconds, steps/s, sequences (or images) per second,
tokens/s, model TFLOP/s, MFU against the device's dense bf16 peak, peak device memory (this
process's: run one workload per process for a figure of its own), whether the step's donated
state buffers were freed (`state_donated`).

Model FLOPs per step (`model_flops`) count the matrix products a training step needs, forward
plus backward = 3 x forward (2 FLOPs per multiply-add), without rematerialisation:
- Transformer layer, per sequence of S tokens, hidden d, FFN f: 2 S (4 d^2 + 2 d f) for the
  projections and the MLP, 4 S^2 d for attention scores and values.
- BERT: L layers + MLM head on the P gathered positions 2 P (d^2 + d V) + pooler/NSP 2 (d^2 + 2d).
- ELECTRA: the discriminator's layers, its embedding projection 2 S E d (E != d) and head
  2 S (d^2 + d); the generator's layers (hidden d_g), projection and head 2 P (d_g E + E V).
- XLNet: per layer, k/v on K = S + M rows (M memory) 4 K d^2, the relative position projection
  on R = K + S rows 2 R d^2, and per query row of a stream q/o 4 d^2, attention 2 d (2 K + R),
  MLP 4 d f; the query stream has P rows (the targets) in every layer, the content stream S
  rows in all but the last (whose output nothing reads); LM head 2 P d V.
- ResNet (SimCLR): XLA's count of the forward FLOPs of the network on the batch of views, plus
  NT-Xent's similarity matrix 2 (2B)^2 p.
For BERT, `mfu_reference_formula` also gives the MFU by torch_text.py's formula (6 N + 12 L d S
per token with N the encoder's parameters, and the MLM head on all S positions, as HF computes
it), which counts more FLOPs per sequence than pretext executes.

Each timed workload also writes its Markdown row of docs/benchmarks.md ("Training-step
throughput", `bench.report`), beside the HF reference figure of `WORKLOADS`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

import jax
import numpy as np

from bench import report
from pretext_jax.input_pipeline.examples.bert import MaskingVocab, mask_tokens, to_features
from pretext_jax.input_pipeline.examples.xlnet import PermutationSampling
from pretext_jax.objectives import registry
from pretext_jax.pretrain.config import Config, make_config
from pretext_jax.pretrain.trainer import Trainer

# Dense bf16 peak per device kind (vendor data sheets), for MFU.
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0, "TPU v4": 275.0, "TPU v5p": 459.0,
               "TPU v5 lite": 197.0, "TPU v6 lite": 918.0}
# Synthetic vocabulary layout: ids below FIRST_WORD_ID are special.
PAD_ID, CLS_ID, SEP_ID, MASK_ID, FIRST_WORD_ID = 0, 2, 3, 4, 5


@dataclasses.dataclass(frozen=True)
class Workload:
    """A preset run at a reference's batch and settings; `reference` is the HF figure in
    sequences (or images) per second on one H100 with torch.compile, `target` this project's."""

    preset: str
    batch_size: int
    vocab_size: int
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    reference: float | None = None
    target: float | None = None


_GPU = {"model.dtype": "bfloat16"}
_TINY = {"train.batch_size": 8, "model.num_layers": 2}
WORKLOADS = {
    "bert_base": Workload("bert_base", 256, 30522, _GPU, 3747, 5600),
    # torch_text.py runs ELECTRA-Base at 128 tokens (the preset's paper length is 512).
    "electra_base": Workload("electra_base", 256, 30522,
                             {**_GPU, "examples.max_seq_length": 128,
                              "examples.max_predictions_per_seq": 19}, 2366, 3550),
    # torch_text.py runs XLNet without memory (mem_len None) on 512 tokens, 85 targets.
    "xlnet_base": Workload("xlnet_base", 32, 32000,
                           {**_GPU, "model.mem_len": 0, "model.bi_data": False,
                            "examples.bi_data": False, "examples.num_streams": 32}, 259, 390),
    "simclr_resnet50": Workload("simclr_imagenet", 256, 0, {}, 5744 / 2, 6900 / 2),
    "simclr_cifar": Workload("simclr_cifar10", 512, 0, _GPU, 63936 / 2, 77000 / 2),
    # CPU smoke sizes (the test suite's).
    "bert_tiny": Workload("bert_tiny", 8, 1000, _TINY),
    "electra_tiny": Workload("electra_tiny", 8, 1000, _TINY),
    "xlnet_tiny": Workload("xlnet_tiny", 8, 1000, {**_TINY, "examples.num_streams": 8}),
    "simclr_tiny": Workload("simclr_tiny", 8, 0, {"train.batch_size": 8, "model.base_width": 4}),
}


TABLE = report.Table("throughput", (
    "workload (preset)", "batch, dtype", "compile s", "step ms", "per s", "MFU",
    "peak GiB", "HF reference per s", "ratio"))


def markdown_cells(result: dict[str, Any]) -> list:
    """A timed workload's cells (`measure`'s result): sequences or images per second."""
    per_s = result.get("images_per_s", result.get("sequences_per_s"))
    unit = "images" if "images_per_s" in result else "sequences"
    return [f"{result['workload']} (`{result['preset']}`)",
            f"{result['batch_size']}, {result['dtype']}", f"{result['compile_s']:.1f}",
            f"{result['step_ms']:.1f}", f"{per_s:,.0f} {unit}",
            f"{result['mfu']:.3f}" if result.get("mfu") is not None else None,
            f"{result['peak_memory_gib']:.1f}" if result.get("peak_memory_gib") else None,
            f"{result['reference_per_s']:,.0f}" if result.get("reference_per_s") else None,
            f"{result['ratio_to_reference']:.2f}" if result.get("ratio_to_reference") else None]


def workload_config(name: str, overrides: list[str] = ()) -> Config:
    """The workload's preset at its batch and settings, then `overrides` (`key=value`)."""
    if name not in WORKLOADS:
        raise SystemExit(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)}")
    work = WORKLOADS[name]
    values = {"train.batch_size": work.batch_size, **work.overrides, "train.progress": False}
    if work.vocab_size:
        values["model.vocab_size"] = work.vocab_size
    return make_config(work.preset, [f"{key}={value}" for key, value in values.items()]
                       + list(overrides))


# ----------------------------------------------------------------------- synthetic batches
def _vocab(vocab_size: int) -> MaskingVocab:
    return MaskingVocab(vocab_size, PAD_ID, CLS_ID, SEP_ID, MASK_ID,
                        np.zeros(vocab_size, bool))


def masked_lm_batch(config: Config, batch_size: int, rng: np.random.Generator
                    ) -> dict[str, np.ndarray]:
    """Full-length `[CLS] A [SEP] B [SEP]` pairs of random words, masked by `mask_tokens` (BERT
    with NSP labels, ELECTRA without)."""
    examples = config.examples
    vocab = _vocab(config.model.vocab_size)
    seq = examples.max_seq_length
    rows = []
    for _ in range(batch_size):
        words = rng.integers(FIRST_WORD_ID, vocab.vocab_size, seq - 3)
        split = int(rng.integers(1, seq - 3))
        tokens = np.concatenate([[CLS_ID], words[:split], [SEP_ID], words[split:], [SEP_ID]])
        segments = (np.arange(seq) > split + 1).astype(np.int32)
        is_random_next = bool(rng.integers(2)) if config.method == "bert" else None
        rows.append(to_features(tokens.astype(np.int32), segments, is_random_next, examples,
                                vocab, mask_tokens(tokens, vocab, examples, rng)))
    return {key: np.stack([row[key] for row in rows]) for key in rows[0]}


def permutation_lm_batch(config: Config, batch_size: int, rng: np.random.Generator
                         ) -> dict[str, np.ndarray]:
    """`[reuse | A | SEP | B | SEP | CLS]` rows of random words with each half's share of the
    targets at random positions, through XLNet's `PermutationSampling`."""
    examples = config.examples
    vocab = _vocab(config.model.vocab_size)
    sampling = PermutationSampling(vocab, examples)
    seq, reuse = examples.max_seq_length, examples.reuse_len
    new = seq - reuse
    reuse_targets, new_targets = examples.predict_per_half
    rows = []
    for _ in range(batch_size):
        ids = rng.integers(FIRST_WORD_ID, vocab.vocab_size, seq).astype(np.int32)
        a_end = reuse + int(rng.integers(1, new - 3))
        ids[[a_end, seq - 2, seq - 1]] = SEP_ID, SEP_ID, CLS_ID
        segments = np.where(np.arange(seq) <= a_end, 0, 1).astype(np.int32)
        segments[-1] = 2
        is_masked = np.zeros(seq, np.int8)
        is_masked[rng.choice(reuse, min(reuse_targets, reuse), replace=False)] = 1
        is_masked[reuse + rng.choice(new - 3, min(new_targets, new - 3), replace=False)] = 1
        rows.append(sampling.random_map(
            {"input_ids": ids, "segment_ids": segments, "is_masked": is_masked}, rng))
    return {key: np.stack([row[key] for row in rows]) for key in rows[0]}


def image_batch(config: Config, batch_size: int, rng: np.random.Generator
                ) -> dict[str, np.ndarray]:
    """Random uint8 images as the loader delivers them: two host crops per image when
    `examples.host_crop_size` is set, else whole images at the views' size."""
    crop = config.examples.host_crop_size
    size = config.objective.image_size
    shape = (batch_size, 2, crop, crop, 3) if crop else (batch_size, size, size, 3)
    return {"image": rng.integers(0, 256, shape, dtype=np.uint8),
            "label": rng.integers(0, 10, batch_size).astype(np.int32)}


SYNTHETIC_BATCHES = {"bert": masked_lm_batch, "electra": masked_lm_batch,
                     "xlnet": permutation_lm_batch, "simclr": image_batch}


def synthetic_batch(config: Config, seed: int = 0) -> dict[str, np.ndarray]:
    """One global training batch of `config`'s method, shaped as its data loader's."""
    if config.method not in SYNTHETIC_BATCHES:
        raise SystemExit(f"no synthetic batches for method {config.method!r}; choose one of "
                         f"{sorted(SYNTHETIC_BATCHES)}")
    return SYNTHETIC_BATCHES[config.method](config, config.train.batch_size,
                                            np.random.default_rng(seed))


def synthetic_data(config: Config) -> registry.PreparedData:
    """PreparedData without records: only the model fields the data would decide."""
    fields = {}
    if config.method == "xlnet" and config.model.mem_len:
        fields["memory_batch_size"] = config.train.batch_size
    return registry.PreparedData(train=None, eval=None, model_fields=fields)


# -------------------------------------------------------------------------------- FLOPs
def transformer_layer_flops(rows: int, keys: int, hidden: int, ffn: int) -> int:
    """Forward FLOPs of one post-LN encoder layer over `rows` queries and `keys` keys."""
    return 2 * rows * (4 * hidden * hidden + 2 * hidden * ffn) + 4 * rows * keys * hidden


def _encoder_flops(model: Any, seq: int) -> int:
    projection = 2 * seq * model.embedding_width * model.hidden_size \
        if model.embedding_width != model.hidden_size else 0
    return model.num_layers * transformer_layer_flops(seq, seq, model.hidden_size,
                                                      model.intermediate_size) + projection


def model_flops(config: Config, batch: dict[str, np.ndarray], trainer: Trainer) -> float:
    """Training FLOPs of one step (see the module docstring for the formulas)."""
    model, batch_size = trainer.model_config, config.train.batch_size
    if config.method in ("bert", "electra"):
        seq = batch["input_ids"].shape[1]
        predictions = batch["masked_lm_positions"].shape[1]
        d, vocab = model.hidden_size, model.vocab_size
        forward = _encoder_flops(model, seq)
        if config.method == "bert":
            forward += 2 * predictions * (d * d + d * vocab) + 2 * (d * d + 2 * d)
        else:
            generator = model.generator_config()
            e = model.embedding_width
            forward += 2 * seq * (d * d + d) + _encoder_flops(generator, seq)
            forward += 2 * predictions * (generator.hidden_size * e + e * vocab)
        return 3.0 * batch_size * forward
    if config.method == "xlnet":
        seq, targets = batch["input_ids"].shape[1], batch["target_positions"].shape[1]
        d, f = model.hidden_size, model.intermediate_size
        keys = seq + model.mem_len
        relative = keys + seq

        def stream(rows: int) -> int:  # q/o projections, attention, MLP of `rows` queries
            return 4 * rows * d * d + 2 * d * (2 * keys + relative) * rows + 4 * rows * d * f

        shared = 4 * keys * d * d + 2 * relative * d * d  # k/v and relative positions
        forward = model.num_layers * (shared + stream(targets))
        forward += (model.num_layers - 1) * stream(seq)  # the last content stream is unused
        forward += 2 * targets * d * model.vocab_size
        return 3.0 * batch_size * forward
    if config.method == "simclr":
        views = 2 * batch_size
        size = trainer.objective.image_size
        network = nnx_forward_flops(trainer, (views, size, size, 3))
        return 3.0 * (network + 2 * views * views * model.projection_dim)
    raise SystemExit(f"no FLOP formula for method {config.method!r}")


def reference_formula_flops(config: Config, seq: int, trainer: Trainer) -> float:
    """torch_text.py's FLOPs of a BERT step: per token 6 N_encoder + 12 L d S + 6 (d^2 + d V)."""
    model = trainer.model_config
    d, f = model.hidden_size, model.intermediate_size
    layer_params = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d  # q/k/v/o, MLP, 2 LayerNorms
    per_token = (6 * model.num_layers * layer_params + 12 * model.num_layers * d * seq
                 + 6 * (d * d + d * model.vocab_size))
    return float(per_token * seq * config.train.batch_size)


def nnx_forward_flops(trainer: Trainer, shape: tuple[int, ...]) -> float:
    """XLA's FLOP count of the model's forward pass (training mode) on float images."""
    from flax import nnx

    def forward(params, rest, images):
        model = nnx.merge(trainer.graphdef, params, rest, copy=True)
        return model(images, train=True).projections

    abstract = trainer.abstract_state
    lowered = jax.jit(forward).lower(abstract.params, abstract.model_state,
                                     jax.ShapeDtypeStruct(shape, np.float32))
    # jax 0.11 on GPU has no cost analysis before compilation (None; bench/gpu_suite
    # 2026-11-28); the compiled program's counts the same operations.
    cost = lowered.cost_analysis() or lowered.compile().cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


# ------------------------------------------------------------------------------ timing
def peak_tflops(device: Any) -> float | None:
    kind = getattr(device, "device_kind", "")
    for name, value in PEAK_TFLOPS.items():
        if name in kind:
            return value
    return None


def peak_memory_bytes(device: Any) -> int | None:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return (stats or {}).get("peak_bytes_in_use")


def trainer_and_batches(config: Config, pool: int) -> tuple[Trainer, list[dict[str, Any]]]:
    """A trainer without records (nothing is written) and `pool` synthetic device batches."""
    trainer = Trainer(config, "/nonexistent-throughput-workdir", data=synthetic_data(config))
    return trainer, [trainer.to_global(synthetic_batch(config, seed)) for seed in range(pool)]


def measure(name: str, overrides: list[str] = (), steps: int = 20,
            warmup: int = 3, pool: int = 2, peak: float | None = None) -> dict[str, Any]:
    """Builds the workload's trainer, compiles its step, runs `warmup` steps, then times
    `steps` steps over a pool of `pool` distinct device batches."""
    config = workload_config(name, overrides)
    trainer, batches = trainer_and_batches(config, pool)
    state = trainer.init_state()
    started = time.perf_counter()
    compiled = trainer._train_step.lower(state, batches[0]).compile()
    compile_s = time.perf_counter() - started
    if steps < 1:
        raise SystemExit("--steps must be at least 1")
    initial = jax.tree.leaves(state.params)[0]  # freed by the first step where donation works
    for step in range(warmup):
        state, _ = compiled(state, batches[step % pool])
    jax.block_until_ready(state)
    started = time.perf_counter()
    for step in range(steps):
        state, metrics = compiled(state, batches[step % pool])
    jax.block_until_ready((state, metrics))
    seconds = (time.perf_counter() - started) / steps
    host = synthetic_batch(config)
    flops = model_flops(config, host, trainer)
    device = jax.devices()[0]
    peak = peak or peak_tflops(device)
    batch_size = config.train.batch_size
    images = config.method == "simclr"
    tokens = 0 if images else batch_size * host["input_ids"].shape[1]
    result = {
        "workload": name, "preset": WORKLOADS[name].preset, "method": config.method,
        "device": device.device_kind, "devices": jax.device_count(), "jax": jax.__version__,
        "batch_size": batch_size, "dtype": trainer.model_config.dtype,
        "compile_s": round(compile_s, 2), "step_ms": round(seconds * 1e3, 3),
        "steps_per_s": 1.0 / seconds,
        ("images_per_s" if images else "sequences_per_s"):
            (2 if images else 1) * batch_size / seconds,
        "tokens_per_s": tokens / seconds if tokens else None,
        "model_tflop_per_step": flops / 1e12, "model_tflops": flops / seconds / 1e12,
        "mfu": flops / seconds / 1e12 / (peak * jax.device_count()) if peak else None,
        "peak_memory_gib": (lambda b: b / 2**30 if b else None)(peak_memory_bytes(device)),
        "state_donated": initial.is_deleted(),
        "loss": float(jax.device_get(metrics["loss"][0] / metrics["loss"][1])),
    }
    if config.method == "bert" and peak:
        result["mfu_reference_formula"] = reference_formula_flops(
            config, host["input_ids"].shape[1], trainer) / seconds / 1e12 / (
                peak * jax.device_count())
    reference = WORKLOADS[name].reference
    if reference:
        unit = (2 if images else 1) * reference
        result["reference_per_s"] = unit
        result["ratio_to_reference"] = result["images_per_s" if images else
                                              "sequences_per_s"] / unit
    return result


def plain_path(config: Config) -> list[str]:
    """Overrides that turn every speed setting of `config`'s model off: float32, layers
    unrolled, no rematerialisation, XLA attention."""
    plain = {"dtype": "float32", "scan_layers": "false", "remat": "none",
             "attention_implementation": "xla"}
    fields = {f.name for f in dataclasses.fields(registry.get(config.method).model_config)}
    return [f"model.{key}={value}" for key, value in plain.items() if key in fields]


def train_losses(config: Config, steps: int, pool: int) -> list[float]:
    """Per-step training losses of `config` on a cycled pool of `pool` synthetic batches."""
    trainer, batches = trainer_and_batches(config, pool)
    state, losses = trainer.init_state(), []
    for step in range(steps):
        state, metrics = trainer._train_step(state, batches[step % pool])
        losses.append(metrics["loss"])
    return [float(total / count) for total, count in jax.device_get(losses)]


def loss_curves(name: str, overrides: list[str] = (), steps: int = 200, pool: int = 4
                ) -> dict[str, Any]:
    """The workload's loss curve as configured and on the plain float32 path (`plain_path`),
    from the same initial parameters on the same batches; a pool of a few batches repeated
    lets the loss fall far, so the curves are compared over a real descent."""
    config = workload_config(name, overrides)
    optimised = train_losses(config, steps, pool)
    plain = train_losses(workload_config(name, [*overrides, *plain_path(config)]), steps, pool)
    difference = np.abs(np.asarray(optimised) - np.asarray(plain))
    return {"workload": name, "steps": steps, "dtype": config.model.dtype,
            "optimised": optimised, "plain_float32": plain,
            "max_abs_difference": float(difference.max()),
            "max_relative_difference": float((difference / np.abs(plain)).max())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", action="append", required=True,
                        help=f"one of {sorted(WORKLOADS)}; repeat for several")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's dense peak for MFU (default: from its kind)")
    parser.add_argument("--loss-curve", type=int, default=0, metavar="STEPS",
                        help="instead of timing, compare this many steps' losses with the "
                             "plain float32 path")
    parser.add_argument("--json", default=None, help="append one JSON line per workload here")
    parser.add_argument("overrides", nargs="*", help="section.key=value for every workload")
    report.add_markdown_argument(parser, "throughput")
    args = parser.parse_args(argv)
    for name in args.workload:
        result = (loss_curves(name, args.overrides, args.loss_curve) if args.loss_curve else
                  measure(name, args.overrides, args.steps, args.warmup, peak=args.peak_tflops))
        line = json.dumps(result)
        print(line, flush=True)
        if args.json:
            with open(args.json, "a") as out:
                out.write(line + "\n")
        if not args.loss_curve:
            report.write_row(TABLE, markdown_cells(result),
                             report.command_line("bench.throughput", argv), args.markdown)


if __name__ == "__main__":
    main(sys.argv[1:])
