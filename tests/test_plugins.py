"""An objective defined outside the package (docs/examples/smoothed_mlm.py, the example of
docs/add_your_own_objective.md) is registered by `run.py --import` and trains from the CLI."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pretext_jax import run
from pretext_jax.objectives import registry

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "docs" / "examples" / "smoothed_mlm.py"


def test_external_objective_trains_from_the_cli(tmp_path):
    workdir = tmp_path / "w"
    result = subprocess.run(
        [sys.executable, str(REPO / "run.py"), "--import", str(EXAMPLE), "pretrain",
         "--preset", "bert_tiny", "--workdir", str(workdir), "method=smoothed_mlm",
         "train.steps=60", "train.log_every=10", "train.eval_every=60",
         "train.checkpoint_every=60", "train.progress=false", "data.vocab_size=1000",
         "examples.max_seq_length=32", "examples.max_predictions_per_seq=5",
         "examples.dupe_factor=1", "train.batch_size=32"],
        capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((workdir / "config.json").read_text())["method"] == "smoothed_mlm"
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if row["split"] == "train"]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.5, losses
    assert "nsp_loss" not in rows[0]  # the example's loss, not BERT's


def test_missing_plugin_is_a_one_line_error(tmp_path, capsys):
    code = run.main(["--import", str(tmp_path / "nope.py"), "pretrain", "--workdir",
                     str(tmp_path / "w")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "nope.py: no such file" in err and "\n" not in err
    assert run.main(["--import", "no_such_module_xyz", "presets"]) == 2
    assert "no_such_module_xyz" in capsys.readouterr().err


NEW_METHOD = '''"""A method from one file: BERT's masked LM alone, from the shared text pieces."""

from flax import nnx

from pretext_jax.input_pipeline.examples import bert as bert_examples
from pretext_jax.models.bert import Bert
from pretext_jax.models.encoder import EncoderConfig
from pretext_jax.objectives.registry import (
    Evaluation,
    Method,
    Resolution,
    register,
    summary_of,
)
from pretext_jax.objectives.common.losses import weighted_cross_entropy
from pretext_jax.objectives.common.masked_lm import check_max_seq_length, prepare_masked_lm


def mlm_only_loss(model, batch, rng):
    out = model(batch["input_ids"], batch["segment_ids"], batch["input_mask"],
                masked_positions=batch["masked_lm_positions"], rng=rng)
    loss, mlm = weighted_cross_entropy(out.mlm_logits, batch["masked_lm_ids"],
                                       batch["masked_lm_weights"])
    return loss, {"loss": mlm["loss"], "mlm_accuracy": mlm["accuracy"]}


def prepare(data, examples, cache_dir, seed):
    return prepare_masked_lm(data, examples, cache_dir, seed,
                             bert_examples.create_training_examples, dynamic_masking=False)


register(Method(name="mlm_only_from_test", model_config=EncoderConfig,
                example_config=bert_examples.BertExampleConfig,
                build_model=lambda config, seed: Bert(config, rngs=nnx.Rngs(seed)),
                loss=mlm_only_loss, prepare=prepare,
                units_per_example=lambda examples: examples.max_seq_length,
                resolution=Resolution(check=check_max_seq_length),
                evaluation=Evaluation(summarize=summary_of(accuracy="mlm"))))
'''


def tree_state() -> str:
    """The checkout's changes as git sees them (empty output where it is no git checkout)."""
    result = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"],
                            cwd=REPO, capture_output=True, text=True)
    return result.stdout if result.returncode == 0 else ""


def test_a_new_method_is_one_file_with_one_registration_line(tmp_path, capsys):
    plugin = tmp_path / "mlm_only_from_test.py"
    plugin.write_text(NEW_METHOD)
    assert NEW_METHOD.count("register(") == 1
    corpus = tmp_path / "corpus.txt"
    sentences = [f"Sentence {i} talks about topic {i % 7} and more words." for i in range(60)]
    corpus.write_text("\n\n".join("\n".join(sentences[i:i + 6]) for i in range(0, 60, 6)))
    before = tree_state()
    code = run.main(["--import", str(plugin), "pretrain", "--data", str(corpus), "--workdir",
                     str(tmp_path / "w"), "method=mlm_only_from_test", "model.hidden_size=32",
                     "model.num_layers=1", "model.num_heads=2", "model.intermediate_size=64",
                     "data.vocab_size=40", "train.batch_size=8", "train.steps=3",
                     "train.eval_every=3", "train.checkpoint_every=3", "train.progress=false"])
    out = capsys.readouterr().out
    assert code == 0
    assert "finished step 3" in out and "held-out MLM accuracy" in out  # its own summary
    assert json.loads((tmp_path / "w" / "config.json").read_text())["method"] == \
        "mlm_only_from_test"
    assert tree_state() == before  # nothing in the tree was edited for it


def test_a_hook_of_the_wrong_arity_is_refused_when_the_method_registers():
    """`register` binds every hook to the arguments the trainer passes (`check_hooks`): a
    `complete_data` written before `load` joined its arguments fails at import, naming the hook,
    not at a run's first call; the same hook with `load` registers."""
    bert = registry.get("bert")

    def without_load(prepared, model_config, objective):
        return prepared

    def with_load(prepared, model_config, objective, load=None):
        return prepared

    stale = dataclasses.replace(bert, name="stale_hook_from_test", presets={},
                                resolution=registry.Resolution(complete_data=without_load))
    with pytest.raises(TypeError, match=r"'stale_hook_from_test': resolution.complete_data "
                                        r"must accept 4 positional arguments"):
        registry.register(stale)
    assert "stale_hook_from_test" not in registry.names()
    registry.check_hooks(dataclasses.replace(
        stale, resolution=registry.Resolution(complete_data=with_load)))
