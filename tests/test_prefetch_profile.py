"""The training loop's device prefetch (batch s + 1 read while step s runs) changes nothing:
same losses, same data position in every checkpoint; `train.profile_steps` writes a
jax.profiler trace of the steps it names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from resilience_utils import TINY_BERT, small_corpus

from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.errors import UserError
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.metrics import read_rows
from pretext_jax.pretrain.trainer import Trainer

SMALL = {**TINY_BERT, "train.steps": 6, "train.checkpoint_every": 2}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    return small_corpus(tmp_path_factory.mktemp("prefetch"))


def run(workdir: Path, data: dict[str, str], **changes) -> dict:
    return Trainer(make_config("bert_tiny", {**SMALL, **data, **changes}), workdir).run()


def losses(workdir: Path) -> list[float]:
    return [row["loss"] for row in read_rows(workdir / "metrics.jsonl")[0]
            if row["split"] == "train"]


def positions(workdir: Path) -> dict[int, str]:
    """The data position each checkpoint keeps (process 0's Grain iterator state)."""
    return {int(p.name): json.loads((p / "data" / "metadata").read_text())["iterator"]
            for p in (workdir / "checkpoints").iterdir()}


def test_prefetch_changes_neither_losses_nor_checkpointed_positions(tmp_path, data):
    run(tmp_path / "on", data, **{"train.prefetch": True})
    run(tmp_path / "off", data, **{"train.prefetch": False})
    assert len(losses(tmp_path / "on")) == 6
    assert losses(tmp_path / "on") == losses(tmp_path / "off")
    assert positions(tmp_path / "on") == positions(tmp_path / "off")
    # the position is that of the batches trained, not of the one read ahead
    step_4 = json.loads(positions(tmp_path / "on")[4])
    assert int(step_4["last_seen_indices"]["0"]) == 4 * SMALL["train.batch_size"] - 1


def test_profile_steps_writes_a_trace(tmp_path, data):
    run(tmp_path / "w", data, **{"train.profile_steps": "2:3", "train.steps": 4})
    traces = list((tmp_path / "w" / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    with pytest.raises(UserError, match="FIRST:LAST"):
        make_config("bert_tiny", {"train.profile_steps": "3:2"})
    with pytest.raises(UserError, match="FIRST:LAST"):
        make_config("bert_tiny", {"train.profile_steps": "soon"})
