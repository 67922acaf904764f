"""wav2vec 2.0 on the one trainer (objectives/wav2vec2.py): the tiny preset trains on a folder of
short clips, a sharded step equals the single-device one, a killed run resumes bit for bit, the
Gumbel temperature follows its schedule over the model's update count, the host-side masks keep
the samplers' statistics, and the CLI runs the preset."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from resilience_utils import GRADIENT_STEP, abort_and_resume, assert_same_training, run_in_process
from test_recipe_cards import CARDS
from test_recipe_cards import value as card_value

from pretext_jax import run
from pretext_jax.errors import UserError
from pretext_jax.models.hf import tables as hf_tables  # noqa: F401  (registers the HF tables)
from pretext_jax.models.hf.conversion import from_hf, to_hf
from pretext_jax.models.wav2vec2 import Wav2Vec2, Wav2Vec2Config, feature_lengths
from pretext_jax.objectives.wav2vec2 import (
    SpanMasking,
    Wav2Vec2ObjectiveConfig,
    gumbel_temperature,
    per_loss_call_decay,
    resolve_for_run,
    span_mask,
)
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.trainer import Trainer

soundfile = pytest.importorskip("soundfile")
pytest.importorskip("soxr")

RATE = 16000
MAX_SAMPLES = 4000  # 49 frames of the tiny encoder (80 samples a frame)
TINY = {"examples.max_samples": MAX_SAMPLES, "train.batch_size": 8, "train.steps": 3,
        "train.log_every": 1, "train.eval_every": 1000, "train.eval_batches": 1,
        "train.checkpoint_every": 3, "train.progress": False, "optim.warmup_steps": 2,
        "data.held_out_fraction": 0.25}


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, str]:
    """32 clips of 0.15-0.5 s (noisy tones, some shorter than a crop) in a folder, and a shared
    record cache."""
    root = tmp_path_factory.mktemp("clips")
    rng = np.random.default_rng(0)
    for i in range(32):
        length = int(rng.integers(2400, 8000))
        t = np.arange(length) / RATE
        samples = 0.3 * np.sin(2 * np.pi * (200 + 40 * (i % 8)) * t) + 0.05 * rng.standard_normal(
            length)
        soundfile.write(str(root / f"{i}.wav"), samples.astype(np.float32), RATE,
                        subtype="PCM_16")
    return {"data.source": str(root), "data.cache_dir": str(root / "cache")}


def tiny_trainer(workdir, clips, mesh=(-1, 1, 1), devices=None, **overrides) -> Trainer:
    values = {**TINY, **clips, "mesh.data": mesh[0], "mesh.fsdp": mesh[1],
              "mesh.tensor": mesh[2], **overrides}
    return Trainer(make_config("wav2vec2_tiny", values), workdir, devices=devices)


def test_tiny_preset_trains_and_its_loss_falls_on_a_repeated_batch(tmp_path, clips):
    trainer = tiny_trainer(tmp_path / "w", clips)
    trainer.run()
    rows = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text()
            .splitlines()]
    train = [row for row in rows if row["split"] == "train"]
    assert [row["step"] for row in train] == [1, 2, 3]
    assert all(np.isfinite(row["loss"]) for row in rows)
    assert any(row["split"] == "eval" and "contrastive_accuracy" in row for row in rows)

    state, batch = trainer.init_state(), next(trainer.data_iterator())
    assert batch["mask_time_indices"].shape == (8, 49)
    assert batch["sampled_negative_indices"].shape == (8, 49, 20)
    losses = []
    for _ in range(12):
        state, metrics = trainer.train_step(state, batch)
        losses.append(float(metrics["loss"][0]))
    assert np.all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 0.1, losses


def test_same_step_on_every_mesh(tmp_path, clips):
    """One gradient step (Gumbel sampling on, two batch groups, each spanning two of the mixed
    mesh's four data shards) gives the same loss, parameters (so gradients) and update count on
    one device and on the (2, 2, 2) mesh, and it moves the parameters."""
    results = {}
    layouts = {"single": ((1, 1, 1), jax.devices()[:1]), "mixed": ((2, 2, 2), None)}
    batch = initial = None
    for name, (mesh, devices) in layouts.items():
        trainer = tiny_trainer(tmp_path / name, clips, mesh=mesh, devices=devices,
                               **GRADIENT_STEP, **{"objective.batch_groups": 2})
        batch = next(trainer.data_iterator()) if batch is None else batch
        state = trainer.init_state()
        initial = jax.device_get(state.params) if initial is None else initial
        state, metrics = trainer.train_step(state, batch)
        moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).max(),
                             jax.device_get(state.params), initial)
        tree = jax.device_get({"params": state.params, "model_state": state.model_state})
        results[name] = (float(metrics["loss"][0]),
                         {jax.tree_util.keystr(k): np.asarray(v)
                          for k, v in jax.tree_util.tree_leaves_with_path(tree)})
    assert max(jax.tree.leaves(moved)) > 1e-2  # a real step (the preset's first lr is 0)
    loss0, params0 = results["single"]
    assert np.isfinite(loss0)
    assert int(params0["['model_state']['updates'].value"]) == 1
    for name, (loss, params) in results.items():
        assert loss == pytest.approx(loss0, rel=1e-6, abs=1e-5), name
        for key, value in params0.items():
            np.testing.assert_allclose(params[key], value, atol=2e-6, rtol=1e-5,
                                       err_msg=f"{name} {key}")


CROP = {"examples.crop_to_shortest": True, "examples.length_buckets": 2,
        "objective.batch_groups": 2}


def test_batches_cropped_to_their_shortest_have_no_padding_and_equal_masks(tmp_path, clips):
    """examples.crop_to_shortest: a batch's rows are equally long (at most two lengths, the
    buckets) and carry no attention_mask, so layer 0's GroupNorm and the feature penalty see
    no padding: a row's conv features are its window's alone, where the padded layout (the same
    window zero-padded to max_samples, as the tiny preset loads it) changes even the frames
    whose receptive fields hold no padding, through the GroupNorm statistics. Masked counts are
    equal within each of the batch_groups groups of 4 rows (the padded preset's are not: the
    negative control). The loader's batches are the same on a second read and continue from a
    saved position; a step trains."""
    trainer = tiny_trainer(tmp_path / "w", clips, **CROP)
    iterator = trainer.data_iterator()
    batches = [next(iterator) for _ in range(4)]
    position, following = iterator.get_state(), next(iterator)
    for batch in batches:
        assert set(batch) == {"audio", "mask_time_indices", "sampled_negative_indices"}
        counts = batch["mask_time_indices"].sum(axis=1).reshape(2, 4)
        assert (counts == counts[:, :1]).all() and counts.min() > 0
    assert len({batch["audio"].shape[1] for batch in batches}) == 2
    again = trainer.data_iterator()
    for batch in batches:
        np.testing.assert_array_equal(next(again)["audio"], batch["audio"])
    again.set_state(position)
    for key, value in next(again).items():
        np.testing.assert_array_equal(value, following[key])
    padded = next(tiny_trainer(tmp_path / "p", clips).data_iterator())
    assert len(set(padded["mask_time_indices"].sum(axis=1).tolist())) > 1

    short = next(batch for batch in batches if batch["audio"].shape[1] < MAX_SAMPLES)
    state = trainer.init_state()
    model = trainer.model_of(state)
    row = jnp.asarray(short["audio"][:1])
    alone = model.extract_features(row)
    np.testing.assert_allclose(model.extract_features(jnp.asarray(short["audio"]))[:1], alone,
                               atol=1e-5)
    zero_padded = jnp.pad(row, ((0, 0), (0, MAX_SAMPLES - row.shape[1])))
    early = alone.shape[1] // 2  # frames whose receptive fields end well before the padding
    assert float(jnp.abs(model.extract_features(zero_padded)[:, :early]
                         - alone[:, :early]).max()) > 1e-3
    state, metrics = trainer.train_step(state, short)
    assert np.isfinite(float(metrics["loss"][0]))


def test_batches_within_a_samples_budget_vary_their_rows(tmp_path, clips):
    """examples.samples_per_batch (fairseq's max_tokens): batches cropped to their shortest,
    rows x length within the budget (no padding, so every sample is real), the row count a
    multiple of the 2 devices and the 2 groups, varying with the length; masked counts equal
    within each group of consecutive rows; the feed counts the batch's samples; the loader
    continues from a saved position; a step trains."""
    budget, devices = 24000, jax.devices()[:2]
    settings = {**CROP, "examples.samples_per_batch": budget, "examples.max_samples": 6000,
                "examples.length_buckets": 3}
    trainer = tiny_trainer(tmp_path / "w", clips, (2, 1, 1), devices, **settings)
    source = trainer.data.segment(1, trainer.run_config).records(None)
    assert source.shapes() == [(6, 3895), (4, 5966), (4, 6000)]
    iterator = trainer.data_iterator()
    batches = [next(iterator) for _ in range(4)]
    position, following = iterator.get_state(), next(iterator)
    for batch in batches:
        rows, length = batch["audio"].shape
        assert rows * length <= budget and rows % 2 == 0 and "attention_mask" not in batch
        assert int(batch.pop("batch_units")) == rows * length
        counts = batch["mask_time_indices"].sum(axis=1).reshape(2, rows // 2)
        assert (counts == counts[:, :1]).all() and counts.min() > 0
    assert len({batch["audio"].shape for batch in batches}) > 1
    again = trainer.data_iterator()
    again.set_state(position)
    for key, value in next(again).items():
        np.testing.assert_array_equal(value, following[key])
    _, metrics = trainer.train_step(trainer.init_state(), batches[0])
    assert np.isfinite(float(metrics["loss"][0]))
    with pytest.raises(UserError, match="samples_per_batch=100 holds no batch"):
        tiny_trainer(tmp_path / "small", clips, (2, 1, 1), devices,
                     **{**settings, "examples.samples_per_batch": 100})


def test_batch_groups_must_split_the_micro_batch():
    config = make_config("wav2vec2_tiny", {"objective.batch_groups": 3})  # 16 rows
    with pytest.raises(UserError, match="does not split into objective.batch_groups=3"):
        resolve_for_run(config.objective, config)
    accumulated = make_config("wav2vec2_tiny", {"objective.batch_groups": 8,
                                                "optim.grad_accum_steps": 2})
    assert resolve_for_run(accumulated.objective, accumulated).batch_groups == 8


def test_the_cards_audio_per_update_is_the_presets():
    """The wav2vec2_base card (docs/methods/speech.md) states the most audio an update holds:
    ours from the preset (examples.samples_per_batch / sample_rate), the paper's from fairseq's
    64 GPUs x max_tokens 1.4 M samples at 16 kHz (its "1.6 h"); at the 250,000 cap a step has
    5 rows per group, as fairseq's 5 per GPU."""
    row = next(row for row in CARDS["wav2vec2_base"].rows
               if row.setting == "audio per update, at most")
    config = make_config("wav2vec2_base")
    examples = config.examples
    assert card_value(row.ours.removesuffix(" s")) == (
        examples.samples_per_batch / examples.sample_rate)
    assert card_value(row.paper.removesuffix(" s")) == 64 * 1_400_000 / 16_000
    assert config.train.batch_size % config.objective.batch_groups == 0
    groups = config.objective.batch_groups
    assert examples.samples_per_batch // examples.max_samples // groups == 1_400_000 // 250_000


def test_update_count_drives_the_gumbel_temperature(tmp_path, clips):
    trainer = tiny_trainer(tmp_path / "w", clips, **{"objective.gumbel_decay": 0.5,
                                                     "objective.gumbel_start_temperature": 2.0})
    state, iterator = trainer.init_state(), trainer.data_iterator()
    temperatures = []
    for _ in range(4):
        state, metrics = trainer.train_step(state, next(iterator))
        temperatures.append(float(metrics["gumbel_temperature"][0]))
    assert int(jax.device_get(state.model_state["updates"].get_value())) == 4
    assert temperatures == pytest.approx([2.0, 1.0, 0.5, 0.5])  # max(2 x 0.5^k, 0.5)
    evaluated = trainer.evaluate(state)
    assert "gumbel_temperature" not in evaluated
    assert int(jax.device_get(state.model_state["updates"].get_value())) == 4

    settings = Wav2Vec2ObjectiveConfig()
    assert float(gumbel_temperature(100_000, settings)) == pytest.approx(
        2 * 0.999995 ** 100_000, rel=1e-5)
    accumulated = make_config("wav2vec2_tiny", {"optim.grad_accum_steps": 4})
    per_call = per_loss_call_decay(settings, accumulated)
    assert per_call.gumbel_decay ** 4 == pytest.approx(settings.gumbel_decay, rel=1e-12)


def test_hf_import_initialises_the_update_count():
    config = Wav2Vec2Config(conv_channels=(8, 8), conv_kernel_sizes=(10, 4),
                            conv_strides=(5, 4), hidden_size=16, num_layers=1, num_heads=2,
                            intermediate_size=32, position_conv_kernel=4,
                            position_conv_groups=2, codevectors_per_group=4,
                            codevector_dim=8, projection_dim=8)
    hf_config, state = to_hf(Wav2Vec2(config, rngs=nnx.Rngs(0)))
    model = from_hf(hf_config, state)
    assert isinstance(model.updates.get_value(), jax.Array)
    assert int(model.updates.get_value()) == 0


def test_host_masks_keep_the_samplers_statistics():
    """Per-utterance draws: about p x n spans of M frames over the real frames only, distractors
    drawn from the other masked frames; the same record and rng seed give the same draws."""
    config = make_config("wav2vec2_tiny").model
    settings = Wav2Vec2ObjectiveConfig()
    masking = SpanMasking(config, settings)
    num_frames = int(feature_lengths(config, 16000))
    rng = np.random.default_rng(0)
    real = np.zeros(16000, np.int32)
    real[:12000] = 1
    frames = int(feature_lengths(config, 12000))
    fractions = []
    for _ in range(200):
        drawn = masking.random_map({"attention_mask": real, "audio": np.zeros(16000)}, rng)
        mask, negatives = drawn["mask_time_indices"], drawn["sampled_negative_indices"]
        assert mask.shape == (num_frames,)
        assert negatives.shape == (num_frames, settings.num_negatives)
        assert not mask[frames:].any()
        masked = np.flatnonzero(mask)
        assert np.isin(negatives[masked], masked).all()
        assert (negatives[masked] != masked[:, None]).all()
        fractions.append(mask.mean() * num_frames / frames)
    # The batch sampler's coverage of utterances of that length (per-batch rounding draws).
    expected = np.mean([span_mask(np.full(8, frames), frames, settings, rng).mean()
                        for _ in range(50)])
    assert 0.4 < expected < 0.6  # spans overlap: about half the frames (§3.1)
    assert np.mean(fractions) == pytest.approx(expected, abs=0.02)
    again = [masking.random_map({"attention_mask": real}, np.random.default_rng(7))
             for _ in range(2)]
    for key in ("mask_time_indices", "sampled_negative_indices"):
        np.testing.assert_array_equal(again[0][key], again[1][key])


def test_killed_run_resumes_bit_for_bit(tmp_path, clips):
    overrides = {**TINY, **clips, "train.steps": 8, "train.checkpoint_every": 3}
    reference = tmp_path / "reference", tmp_path / "reference.log"
    run_in_process("wav2vec2_tiny", overrides, *reference)
    ours = abort_and_resume("wav2vec2_tiny", overrides, tmp_path, step=5)
    executed = assert_same_training("wav2vec2_tiny", overrides, ours, reference)
    assert len(executed) > 8  # the kill lost steps after the step-3 checkpoint, which were redone
    counts = []
    for workdir, _ in (ours, reference):
        trainer = Trainer(make_config("wav2vec2_tiny", overrides), workdir)
        state, _ = trainer.checkpoints.restore_latest_readable()
        trainer.checkpoints.close()
        counts.append(int(jax.device_get(state.model_state["updates"].get_value())))
    assert counts == [8, 8]


def test_cli_pretrains_the_tiny_preset(tmp_path, clips):
    assert run.main(["pretrain", "--preset", "wav2vec2_tiny", "--data", clips["data.source"],
                     "--workdir", str(tmp_path / "run"), "train.steps=2", "train.batch_size=8",
                     f"examples.max_samples={MAX_SAMPLES}", "train.progress=false",
                     f"data.cache_dir={clips['data.cache_dir']}",
                     "data.held_out_fraction=0.25"]) == 0
    assert (tmp_path / "run" / "metrics.jsonl").exists()
