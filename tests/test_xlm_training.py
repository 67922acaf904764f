"""XLM on the one trainer (objectives/xlm.py, Lample & Conneau 2019 §3): the tiny preset trains
CLM, MLM and TLM from the CLI with falling held-out loss, TLM batches reach the loss with
positions reset and a language per half, one sharded step equals the single-device step, a
killed run resumes bit for bit, and a workdir converts to HF and back."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from parity_utils import XLM_LM, classifier_parity
from resilience_utils import (
    GRADIENT_STEP,
    abort_and_resume,
    assert_same_step_on_every_mesh,
    assert_same_training,
    run_in_process,
)
from text_utils import WORDS, sentences

from pretext_jax import run
from pretext_jax.errors import UserError
from pretext_jax.objectives.xlm import xlm_loss
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.trainer import Trainer

TINY = {"model.hidden_size": 32, "model.num_layers": 1, "model.num_heads": 2,
        "model.intermediate_size": 128, "model.max_position_embeddings": 64,
        "model.embed_init_std": 32 ** -0.5, "examples.stream_length": 64,
        "examples.max_sentence_length": 30, "examples.max_predictions_per_seq": 5,
        "data.vocab_size": 40, "data.held_out_fraction": 0.2, "train.batch_size": 16,
        "train.log_every": 1, "train.eval_batches": 2, "train.progress": False,
        "optim.warmup_steps": 2}


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, str]:
    """Monolingual files (documents of 8 sentences, blank lines between), a line-aligned
    training and a held-out parallel corpus, and a shared record cache."""
    root = tmp_path_factory.mktemp("xlm")
    for index, language in enumerate(("en", "de")):
        lines = [pair[index] for pair in sentences(480, seed=index)]
        (root / f"mono.{language}").write_text(
            "\n\n".join("\n".join(lines[i:i + 8]) for i in range(0, len(lines), 8)) + "\n")
    for split, count in (("train", 400), ("valid", 64)):
        pairs = sentences(count, seed=10 + count)
        for index, language in enumerate(("en", "de")):
            (root / f"{split}.{language}").write_text("".join(p[index] + "\n" for p in pairs))
    return {"mono": f"en={root / 'mono.en'},de={root / 'mono.de'}",
            "train": f"{root / 'train.en'},{root / 'train.de'}",
            "valid": f"{root / 'valid.en'},{root / 'valid.de'}",
            "data.cache_dir": str(root / "cache")}


def task_settings(task: str, corpora: dict[str, str]) -> dict:
    """TLM holds out the valid pairs; MLM + TLM holds out a fraction of the training pairs."""
    source = {"data.source": corpora["train"], "data.eval_source": corpora["valid"]} if (
        task == "tlm") else {"data.source": corpora["mono"]}
    if task == "mlm_tlm":
        source["examples.tlm_source"] = corpora["train"]
    return {**TINY, **source, "examples.task": task, "data.cache_dir": corpora["data.cache_dir"]}


def eval_losses(workdir: Path) -> list[float]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if row["split"] == "eval"]


@pytest.mark.parametrize("task", ["mlm", "tlm", "clm", "mlm_tlm"])
def test_each_task_trains_from_the_cli_with_falling_held_out_loss(task, corpora, tmp_path):
    settings = {**task_settings(task, corpora), "train.steps": 30, "train.eval_every": 10,
                "train.checkpoint_every": 30, "optim.learning_rate": 5e-3}
    workdir = tmp_path / task
    assert run.main(["pretrain", "--preset", "xlm_tiny", "--data", settings.pop("data.source"),
                     "--workdir", str(workdir),
                     *(f"{k}={v}" for k, v in settings.items())]) == 0
    losses = eval_losses(workdir)
    # Falling, and well below the uniform guess over the 40 pieces (ln 40 = 3.69).
    assert len(losses) == 3 and losses[-1] < min(losses[0] - 0.1, np.log(40) - 0.4), losses
    saved = json.loads((workdir / "model.json").read_text())
    assert saved["model"]["n_langs"] == 2 and saved["model"]["causal"] == (task == "clm")


def tiny_trainer(workdir: Path, settings: dict, mesh=(-1, 1, 1), devices=None, **more) -> Trainer:
    values = {**settings, "mesh.data": mesh[0], "mesh.fsdp": mesh[1], "mesh.tensor": mesh[2],
              "train.steps": 4, "train.eval_every": 1000, **more}
    return Trainer(make_config("xlm_tiny", values), workdir, devices=devices)


def test_tlm_batches_reach_the_loss_with_reset_positions_and_a_language_per_half(corpora,
                                                                                  tmp_path):
    trainer = tiny_trainer(tmp_path / "w", task_settings("tlm", corpora))
    batch = next(trainer.data_iterator())
    tokenizer = trainer.data.tokenizer
    assert trainer.model_config.n_langs == 2 and not trainer.model_config.causal
    masked = 0
    for row in range(len(batch["input_ids"])):
        length = int(batch["input_mask"][row].sum())
        ends = np.flatnonzero(batch["positions"][row][:length] == 0)
        assert ends.tolist() == [0, ends[1]] and 2 < ends[1] < length - 2
        first, second = (slice(0, ends[1]), slice(ends[1], length))
        for half in (first, second):
            np.testing.assert_array_equal(batch["positions"][row][half],
                                          np.arange(half.stop - half.start))
            assert len(set(batch["langs"][row][half].tolist())) == 1
        assert batch["langs"][row][0] != batch["langs"][row][ends[1]]
        ids = batch["input_ids"][row]
        assert ids[0] == ids[ends[1]] == tokenizer.eos_id  # </s> opens each half
        weights = batch["masked_lm_weights"][row] > 0
        masked += int((batch["masked_lm_positions"][row][weights] >= ends[1]).sum())
    assert masked > 0  # masks reach the translations too
    # The loss reads the records' positions and languages: other values change it.
    model = trainer.method.build_model(trainer.model_config, 0)
    loss = float(xlm_loss(model, batch, None)[0])
    for key, value in (("positions", np.tile(np.arange(64), (16, 1))),
                       ("langs", np.zeros_like(batch["langs"]))):
        assert float(xlm_loss(model, {**batch, key: value}, None)[0]) != pytest.approx(loss)


@pytest.mark.parametrize("task", ["tlm", "clm"])
def test_same_step_on_every_mesh(task, corpora, tmp_path):
    """One plain gradient step gives the same loss and parameters on one device and on meshes
    of 8 (data and mixed), and it moves the parameters."""
    assert_same_step_on_every_mesh(
        lambda workdir, mesh, devices: tiny_trainer(workdir, task_settings(task, corpora), mesh,
                                                    devices, **GRADIENT_STEP), tmp_path)


def test_mlm_tlm_steps_alternate_one_language_or_pair_per_batch(corpora, tmp_path):
    """Each training batch is one step of the schedule: a language's streams (positions
    0..n-1, its language id) or the en-de / de-en pairs (positions reset, a language per
    half), with 2 monolingual then 2 pair steps per cycle; and TLM is held out by a fraction
    of the parallel lines."""
    trainer = tiny_trainer(tmp_path / "w", task_settings("mlm_tlm", corpora),
                           **{"data.held_out_fraction": 0.25})
    schedule = trainer.data.segment(1, trainer.config).records(None)
    assert set(schedule.names) == {"en", "de", "de-en", "en-de"} and schedule.cycle_steps == 4
    ids = {"de": 0, "en": 1}
    iterator = trainer.data_iterator()
    seen = []
    state = trainer.init_state()
    for step in range(12):
        batch = next(iterator)
        name = schedule.names[schedule.step_set(step)]
        seen.append(name)
        if step < 4:  # a whole cycle: MLM and TLM batches, one compiled step
            state, _ = trainer.train_step(state, batch)
        assert (step % 4 < 2) == ("-" not in name)
        for row in range(16):
            real = batch["input_mask"][row] > 0
            langs, positions = batch["langs"][row][real], batch["positions"][row][real]
            if "-" not in name:
                assert (langs == ids[name]).all()
                np.testing.assert_array_equal(positions, np.arange(real.sum()))
            else:
                second = int(np.flatnonzero(positions == 0)[1])
                assert (langs[:second] == ids[name[:2]]).all() and (
                    langs[second:] == ids[name[3:]]).all()
    assert {"en", "de"} <= set(seen) and {"de-en", "en-de"} <= set(seen)
    assert trainer._train_step._cache_size() == 1
    # The held-out set interleaves the languages' streams and the held-out pairs.
    held = trainer.data.eval
    pairs = (held["positions"][:, 1:] == 0).any(axis=1)
    assert 0 < pairs[:16].sum() < 16 and pairs.sum() >= 2 * 100 * 0.25 * 0.9


def test_killed_run_resumes_bit_for_bit(corpora, tmp_path):
    overrides = {**task_settings("mlm_tlm", corpora), "train.steps": 8, "train.checkpoint_every": 3,
                 "train.eval_every": 1000, "train.eval_batches": 1}
    reference = tmp_path / "reference", tmp_path / "reference.log"
    run_in_process("xlm_tiny", overrides, *reference)
    ours = abort_and_resume("xlm_tiny", overrides, tmp_path, step=5)
    executed = assert_same_training("xlm_tiny", overrides, ours, reference)
    assert len(executed) > 8  # steps after the step-3 checkpoint were lost and redone


def test_workdir_converts_to_hf_and_back(corpora, tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from pretext_jax.pretrain.loading import load_model

    settings = {**task_settings("mlm", corpora), "train.steps": 2, "train.eval_every": 2,
                "train.eval_batches": 1}
    Trainer(make_config("xlm_tiny", settings), tmp_path / "w").run()
    assert run.main(["convert", str(tmp_path / "w"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    theirs = transformers.XLMWithLMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ours = load_model(tmp_path / "w")
    ids = np.array([[5, 9, 12, 3, 7, 11]], np.int64)
    langs = np.array([[0, 0, 0, 1, 1, 1]], np.int64)
    XLM_LM.assert_parity(ours, theirs, ids, None, langs)
    assert run.main(["convert", str(tmp_path / "hf"), str(tmp_path / "back"), "--to",
                     "pretext"]) == 0
    back = load_model(tmp_path / "back")
    assert back.config == ours.config
    np.testing.assert_array_equal(np.asarray(back.word_embeddings.embedding[...]),
                                  np.asarray(ours.word_embeddings.embedding[...]))
    np.testing.assert_array_equal(np.asarray(back.lang_embeddings.embedding[...]),
                                  np.asarray(ours.lang_embeddings.embedding[...]))


def test_config_errors(corpora, tmp_path):
    with pytest.raises(UserError, match="examples.task=clm"):
        make_config("xlm_tiny", {"model.causal": True})
    with pytest.raises(UserError, match="examples.task"):
        make_config("xlm_tiny", {"examples.task": "mt"})
    with pytest.raises(UserError, match="model.is_decoder=false"):
        make_config("xlm_tiny", {"model.is_decoder": True, "model.causal": True,
                                 "examples.task": "clm"})
    with pytest.raises(UserError, match="examples.tlm_source"):
        make_config("xlm_tiny", {"examples.task": "mlm_tlm"})
    with pytest.raises(UserError, match="stream_length"):
        make_config("xlm_tiny", {"model.max_position_embeddings": 32})


def test_glue_finetune_from_a_pretrained_xlm_workdir_and_export_to_hf(corpora, tmp_path):
    """A pre-trained xlm_tiny workdir fine-tunes on a tiny SST-2 (label: "cat" or "dog" in the
    sentence) with XLM's recipe and input layout, starting from its weights, and the classifier
    exports to HF `XLMForSequenceClassification` with the same logits."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from pretext_jax.pretrain.finetune import finetune, finetune_config
    from pretext_jax.pretrain.loading import load_model

    workdir = tmp_path / "pretrained"
    Trainer(make_config("xlm_tiny", {**task_settings("mlm", corpora), "train.steps": 2,
                                     "train.eval_every": 2, "train.eval_batches": 1}),
            workdir).run()
    glue = tmp_path / "glue" / "SST-2"
    glue.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, count in (("train", 160), ("dev", 48)):
        labels = rng.integers(0, 2, count)
        rows = []
        for label in labels:
            words = [*rng.choice(WORDS["en"][4:], 5), "cat" if label else "dog"]
            rng.shuffle(words)
            rows.append(f"{' '.join(words)}\t{label}")
        (glue / f"{split}.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    config = finetune_config("sst2", str(workdir), str(glue.parent),
                             ["examples.max_seq_length=16", "optim.learning_rate=5e-3",
                              "train.progress=false"], epochs=2)
    assert (config.model.head, config.examples.layout) == ("xlm", "xlm")
    assert (config.train.batch_size, config.optim.schedule, config.optim.warmup_steps,
            config.optim.eps, config.train.steps) == (8, "constant", 0, 1e-8, 40)
    trainer = Trainer(config, tmp_path / "run")
    pretrained = load_model(workdir)
    params = nnx.to_pure_dict(trainer.init_state().params)["transformer"]
    np.testing.assert_array_equal(params["word_embeddings"]["embedding"],
                                  pretrained.word_embeddings.embedding[...])
    np.testing.assert_array_equal(params["layers"]["query"]["kernel"],
                                  pretrained.layers.query.kernel[...])
    dev = trainer.data.eval
    eos = trainer.data.tokenizer.eos_id
    assert (dev["input_ids"][:, 0] == eos).all()  # </s> A </s>
    lengths = dev["attention_mask"].sum(1)
    assert (dev["input_ids"][np.arange(len(lengths)), lengths - 1] == eos).all()
    result = finetune(config, tmp_path / "run")
    assert result["dev"]["accuracy"] > 0.8 and not result["at_majority_baseline"], result
    assert run.main(["convert", str(tmp_path / "run"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    architecture = "XLMForSequenceClassification"
    reference = getattr(transformers, architecture).from_pretrained(tmp_path / "hf").eval()
    classifier_parity(architecture).assert_parity(
        load_model(tmp_path / "run"), reference, dev["input_ids"][:4].astype(np.int64), None,
        dev["attention_mask"][:4])
