"""Batches within a token budget (`input_pipeline/token_batches.py`; XLM's `tokens_per_batch`,
fairseq's `max_tokens`): the epoch plan's statistics against a negative control, the budget
refusal, and `mass_xlm` trained on them on the 8 fake devices: varying rows in a few shapes, the
real tokens counted, a killed run resumed bit for bit across an epoch boundary."""

from __future__ import annotations

import numpy as np
import pytest
from resilience_utils import abort_and_resume, assert_same_training, run_in_process

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import token_batches as tb
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.feed import StepFeed
from pretext_jax.pretrain.trainer import Trainer


def plan_violations(lengths, buckets, rows, batches, shapes, budget, multiple):
    """What a plan breaks: a batch over the budget, rows not a multiple of `multiple`, a row
    longer than its batch's length, a record read twice, or more left out than the longest
    bucket's row count."""
    problems = []
    for batch, shape in zip(batches, shapes, strict=True):
        length = buckets[shape]
        if len(batch) * length > budget:
            problems.append(f"{len(batch)} x {length} > {budget}")
        if len(batch) % multiple or len(batch) != rows[shape]:
            problems.append(f"{len(batch)} rows")
        if lengths[batch].max() > length:
            problems.append(f"a row of {lengths[batch].max()} in a batch of {length}")
    used = np.concatenate(batches)
    if len(np.unique(used)) != len(used):
        problems.append("a record read twice")
    if len(lengths) - len(used) >= rows[-1]:
        problems.append(f"{len(lengths) - len(used)} records left out")
    return problems


def test_plan_fits_the_budget_and_reads_every_record_once():
    """Every batch's rows x length within the budget, its rows a multiple of 8 and of its
    bucket's count, no row longer than its batch, every record once per epoch but for fewer
    than one longest batch; plans repeat for (seed, epoch) and differ between epochs. The
    negative control, twice the rows per batch, breaks the budget."""
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(6, 40, 3000), rng.integers(60, 102, 400)])
    budget, multiple = 3000, 8
    buckets = tb.bucket_lengths(lengths, 6)
    rows = tb.rows_per_bucket(buckets, budget, multiple)
    assert len(buckets) == 6 and buckets[-1] == lengths.max() and buckets[0] == lengths.min()
    assert list(rows) == [budget // b // 8 * 8 for b in buckets]
    batches, shapes = tb.plan_epoch(lengths, buckets, rows, np.random.default_rng([1, 0]))
    assert plan_violations(lengths, buckets, rows, batches, shapes, budget, multiple) == []
    assert len(set(len(b) for b in batches)) > 3  # the row count varies per step
    # Real tokens per padded token: over twice the share of fixed rows of the longest length.
    padded = sum(len(b) * buckets[s] for b, s in zip(batches, shapes, strict=True))
    real = sum(lengths[b].sum() for b in batches) / padded
    assert real > 2 * lengths.mean() / lengths.max(), real
    again, _ = tb.plan_epoch(lengths, buckets, rows, np.random.default_rng([1, 0]))
    assert all(np.array_equal(a, b) for a, b in zip(batches, again, strict=True))
    other, _ = tb.plan_epoch(lengths, buckets, rows, np.random.default_rng([1, 1]))
    assert len(other) == len(batches)
    assert not all(np.array_equal(a, b) for a, b in zip(batches, other, strict=True))
    # The batches are read in a shuffled order, not by length.
    assert not np.all(np.diff(shapes) >= 0) and not np.all(np.diff(shapes) <= 0)
    # Negative control: twice the rows breaks the budget and drops most records.
    doubled, doubled_shapes = tb.plan_epoch(lengths, buckets, rows * 2,
                                            np.random.default_rng([1, 0]))
    assert any("> 3000" in p for p in plan_violations(
        lengths, buckets, rows, doubled, doubled_shapes, budget, multiple))


def test_a_budget_below_one_multiple_of_the_longest_rows_is_refused():
    with pytest.raises(UserError, match=r"tokens_per_batch=700 .* at least 808"):
        tb.rows_per_bucket(np.array([20, 101]), 700, 8)
    assert list(tb.rows_per_bucket(np.array([20, 101]), 808, 8)) == [40, 8]


def varied_corpus(root):
    """15 documents of 4 sentences of 2 to 12 made-up words (so segments' lengths vary); the
    data settings that read it."""
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(2, 7)))
             for _ in range(80)]
    documents = ["\n".join(" ".join(rng.choice(words, rng.integers(2, 13))) + "."
                           for _ in range(4)) for _ in range(15)]
    (root / "corpus.txt").write_text("\n\n".join(documents) + "\n")
    return {"data.source": str(root / "corpus.txt"), "data.cache_dir": str(root / "cache")}


BUDGET = {"model.hidden_size": 32, "model.num_heads": 2, "model.intermediate_size": 128,
          "model.num_layers": 1, "examples.max_seq_length": 40, "data.vocab_size": 60,
          "examples.tokens_per_batch": 480, "examples.length_buckets": 3,
          "train.batch_size": 16, "train.steps": 8, "train.log_every": 1,
          "train.eval_every": 1000, "train.eval_batches": 1, "train.checkpoint_every": 3,
          "train.progress": False, "data.held_out_fraction": 0.2}


def test_mass_xlm_trains_on_token_budget_batches_and_resumes_exactly(tmp_path):
    """`mass_xlm_tiny` with examples.tokens_per_batch on the 8 fake devices: batches of a few
    (rows, length) shapes whose rows vary from step to step, each within the budget, the feed
    counting their real tokens (the encoder's unpadded positions); a run killed in place of
    step 5 (its last checkpoint at step 3) and rerun reads the same batches, across an epoch's
    end, with the same losses and parameters bit for bit as an uninterrupted run."""
    overrides = {**BUDGET, **varied_corpus(tmp_path)}
    trainer = Trainer(make_config("mass_xlm_tiny", overrides), tmp_path / "look")
    source = trainer.data.segment(1, trainer.run_config).records(None)
    assert len(source.shapes()) == 3 and all(r * n <= 480 and r % 8 == 0
                                             for r, n in source.shapes())
    assert source.batches_per_epoch < BUDGET["train.steps"]  # the run crosses an epoch
    feed = StepFeed(trainer.data, trainer.run_config, trainer.per_process_batch,
                    lambda state: None, trainer.begin_segment)
    shapes = set()
    for step in range(1, 9):
        _, batch = feed.batch(None, step)
        rows, length = batch["inputs"].shape
        assert (rows, length) in source.shapes() and "batch_units" not in batch
        assert feed.units == batch["input_mask"].sum()  # real tokens: </s> x </s>
        shapes.add((rows, length))
    assert len(shapes) > 1
    reference = tmp_path / "reference", tmp_path / "reference.log"
    run_in_process("mass_xlm_tiny", overrides, *reference)
    ours = abort_and_resume("mass_xlm_tiny", overrides, tmp_path, step=5)
    assert len(assert_same_training("mass_xlm_tiny", overrides, ours, reference)) > 8


def test_bilingual_steps_read_the_next_batch_of_their_language(tmp_path):
    """A bilingual corpus: each step's batch is of the language the step schedule draws (XLM's
    one language per step) and is that language's next planned batch, within the budget; a
    source built afresh (a resume) reads step 7 as the one read in order did."""
    (tmp_path / "de").mkdir()
    data = {"data.source": "en={},de={}".format(varied_corpus(tmp_path)["data.source"],
                                               varied_corpus(tmp_path / "de")["data.source"]),
            "data.cache_dir": str(tmp_path / "cache")}
    config = make_config("mass_xlm_tiny", {**BUDGET, **data})
    trainer = Trainer(config, tmp_path / "w")
    source = trainer.data.segment(1, trainer.run_config).records(None)
    read = [source[key] for key in range(8)]
    taken = [0, 0]
    for key, batch in enumerate(read):
        language = source.schedule.step_set(key)
        assert (batch["language_ids"] == language).all()
        assert batch["inputs"].size <= BUDGET["examples.tokens_per_batch"]
        expected = source.sources[language][taken[language]]
        assert all(np.array_equal(batch[k], expected[k]) for k in expected)
        taken[language] += 1
    assert min(taken) > 0
    again = type(source)(source.schedule, source.sources)[7]
    assert all(np.array_equal(again[k], read[7][k]) for k in again)


@pytest.mark.parametrize("preset", ["mass_tiny", "prophetnet_tiny"])
def test_t5_layout_methods_take_the_budget(tmp_path, preset):
    """MASS on T5 and ProphetNet read MASS's records in T5's layout: every field of a batch
    is cut to its length, the decoder's targets lie within the real tokens, a step's loss is
    finite. With gradient accumulation the rows are a multiple of the shards x micro-batches
    (16 on 8 devices with 2), and a non-finite step names its batch, not an example range."""
    data = {key: value for key, value in BUDGET.items() if not key.startswith("model.")}
    model = ({"model.hidden_size": 32, "model.num_heads": 2, "model.intermediate_size": 64,
              "model.num_layers": 1} if preset == "mass_tiny" else {})
    overrides = {**data, **model, **varied_corpus(tmp_path)}
    trainer = Trainer(make_config(preset, overrides), tmp_path / "w")
    source = trainer.data.segment(1, trainer.run_config).records(None)
    batch = source[0]
    rows, length = batch["inputs"].shape
    assert (rows, length) in source.shapes() and int(batch.pop("batch_units")) == (
        batch["input_mask"].sum())
    assert all(value.shape[:2] == (rows, length) for value in batch.values())
    assert not (batch["targets"] * (1 - batch["input_mask"])).any()
    _, metrics = trainer.train_step(trainer.init_state(), batch)
    assert np.isfinite(float(metrics["loss"][0]))
    accumulated = Trainer(make_config(preset, {**overrides, "optim.grad_accum_steps": 2,
                                               "examples.tokens_per_batch": 640}),
                          tmp_path / "a")
    assert all(rows % 16 == 0 for rows, _ in
               accumulated.data.segment(1, accumulated.run_config).records(None).shapes())
    segment = trainer.data.segment(1, trainer.run_config)
    with pytest.raises(UserError, match=r"at step 3 \(batch 2 of the training stream"):
        trainer._check_finite([(3, np.float32(1.0))], segment)
