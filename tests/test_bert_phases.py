"""BERT's two phases in one run (google-research/bert README: 90 % of the steps at 128 tokens
with 20 predictions, the last 10 % at 512 with 80, so that positions 128-511 are learned):
`examples.long_phase_fraction` (`objectives.common.masked_lm.phases`)."""

from __future__ import annotations

import numpy as np
import pytest
from resilience_utils import (
    TINY_BERT,
    abort_and_resume,
    assert_same_training,
    run_in_process,
    small_corpus,
)

from pretext_jax.errors import UserError
from pretext_jax.objectives.common.masked_lm import long_phase_start
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.trainer import Trainer

# 8 steps: 1-6 at 32 tokens (5 predictions), 7-8 at 64 (10 predictions).
PHASES = {**TINY_BERT, "examples.long_phase_fraction": 0.25, "examples.long_max_seq_length": 64,
          "examples.long_max_predictions_per_seq": 10}


def test_presets_train_the_last_tenth_at_512():
    for preset in ("bert_base", "bert_large"):
        examples = make_config(preset).examples
        assert (examples.max_seq_length, examples.max_predictions_per_seq,
                examples.long_phase_fraction, examples.long_max_seq_length,
                examples.long_max_predictions_per_seq) == (128, 20, 0.1, 512, 80)
    assert long_phase_start(1_000_000, 0.1) == 900_001 and long_phase_start(8, 0.25) == 7
    with pytest.raises(UserError, match="long_max_seq_length=600 exceeds"):
        make_config("bert_base", {"examples.long_max_seq_length": 600})
    with pytest.raises(UserError, match="needs static masks"):
        make_config("bert_base", {"examples.dynamic_masking": True})


def test_the_long_phase_reads_long_examples_and_resumes_exactly_across_the_switch(tmp_path):
    """Steps before `long_phase_start` read the first phase's records, the rest the long
    phase's (prepared again at its length); a run killed in the first long step resumes from
    the last checkpoint of the first phase and ends bit for bit as an uninterrupted run."""
    overrides = {**PHASES, **small_corpus(tmp_path)}
    trainer = Trainer(make_config("bert_tiny", overrides), tmp_path / "look")
    first, second = (trainer.data.segment(step, trainer.config) for step in (6, 7))
    assert (first.first_step, first.last_step, second.first_step, second.last_step) == (
        1, 6, 7, None)
    short, long = (segment.records(None).examples(range(40)) for segment in (first, second))
    assert short["input_ids"].shape == (40, 32) and short["masked_lm_ids"].shape == (40, 5)
    assert long["input_ids"].shape == (40, 64) and long["masked_lm_ids"].shape == (40, 10)
    # positions past the first phase's length are trained
    assert np.count_nonzero(long["input_ids"], axis=1).max() > 32
    trainer.checkpoints.close()
    reference = tmp_path / "reference", tmp_path / "reference.log"
    run_in_process("bert_tiny", overrides, *reference)
    ours = abort_and_resume("bert_tiny", overrides, tmp_path, step=7)
    executed = assert_same_training("bert_tiny", overrides, ours, reference)
    assert [step for step, _ in executed].count(7) == 2  # step 7 ran, was lost, ran again
