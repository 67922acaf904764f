"""run.py: bad input gives one line naming the fix, exit 2, and leaves the workdir untouched
(every case run as its own process, so tracebacks, stderr floods and hangs are seen); the demo
learns something (held-out MLM accuracy above the majority-token baseline)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tfds_utils import build_text_dataset

from pretext_jax import run

REPO = Path(__file__).resolve().parent.parent
SMALL = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
         "model.intermediate_size=64", "train.steps=2", "train.progress=false"]
TRAINED = ["data.vocab_size=40", "train.batch_size=8"]  # the module's finished run


def snapshot(directory: Path) -> dict[str, bytes]:
    if directory.is_file():  # a --workdir that names a file
        return {"": directory.read_bytes()}
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    sentences = [f"Sentence {i} talks about topic {i % 7} and more words." for i in range(60)]
    path.write_text("\n\n".join("\n".join(sentences[i:i + 6]) for i in range(0, 60, 6)) + "\n")
    return path


def bad_inputs(tmp: Path, corpus: Path) -> dict[str, tuple[list[str], str]]:
    empty = tmp / "empty.txt"
    empty.write_text("\n\n   \n")
    garbage_vocab = tmp / "vocab.txt"
    garbage_vocab.write_bytes(b"\xff\xfe\x00garbage\x00\n")
    small_vocab = tmp / "small_vocab.txt"
    words = sorted({w.strip(".").lower() for w in corpus.read_text().split()})
    small_vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", *words]))
    broken_hf = tmp / "hf_tokenizer"
    broken_hf.mkdir(exist_ok=True)
    shutil.copy(small_vocab, broken_hf / "vocab.txt")
    (broken_hf / "tokenizer_config.json").write_text('{"do_lower_case": tru')
    not_utf8 = tmp / "latin1.txt"
    not_utf8.write_bytes("Caf\u00e9 au lait.\n".encode("latin-1") * 20)
    cifar = tmp / "cifar"
    cifar.mkdir(exist_ok=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with (cifar / name).open("wb") as f:  # 32 x 31 pixels: not CIFAR's 32 x 32
            pickle.dump({b"data": np.zeros((4, 2976), np.uint8), b"labels": [0, 1, 2, 3]}, f)
    return {
        "missing corpus": (["--data", str(tmp / "nope.txt")], "nope.txt"),
        "empty corpus": (["--data", str(empty)], "empty"),
        "vocab that does not parse": (["--data", str(corpus), "--tokenizer",
                                       str(garbage_vocab)], "vocab"),
        "tokenizer and model disagree": (["--data", str(corpus), "--tokenizer", str(small_vocab),
                                          "model.vocab_size=500"], "does not match"),
        "sequence longer than positions": (["--data", str(corpus),
                                            "examples.max_seq_length=256"],
                                           "max_position_embeddings"),
        "batch not divisible by data axes": (["--data", str(corpus), "train.batch_size=12"],
                                             "divisible"),
        "unknown config key": (["--data", str(corpus), "train.stepz=3"], "train.stepz"),
        "value of the wrong type": (["--data", str(corpus), "train.steps=many"], "train.steps"),
        "unknown preset": (["--data", str(corpus), "--preset", "bert_huge"], "preset"),
        "override without a section": (["--data", str(corpus), "steps=3"], "section"),
        "mesh that does not fit": (["--data", str(corpus), "mesh.data=3"], "mesh"),
        "workdir of another run": (["--data", str(corpus), "model.hidden_size=48"],
                                   "another config"),
        "generator larger than discriminator": (["--data", str(corpus), "--preset",
                                                 "electra_tiny", "model.generator_hidden_size=2"],
                                                "generator_hidden_size=2"),
        "BERT key for ELECTRA": (["--data", str(corpus), "--preset", "electra_tiny",
                                  "examples.dupe_factor=2"], "examples.dupe_factor"),
        "masking fractions over 1": (["--data", str(corpus), "examples.mask_token_prob=0.95"],
                                     "mask_token_prob"),
        "text that is not UTF-8": (["--data", str(not_utf8)], "not UTF-8"),
        "TFDS dataset not prepared": (["--data", "tfds:tiny_wiki",
                                       f"data.tfds_data_dir={tmp / 'tfds'}"],
                                      "--file_format=array_record"),
        "images of the wrong shape": (["--preset", "simclr_tiny", "--data", str(cifar)],
                                      "3072 bytes"),
        "unknown non-finite policy": (["--data", str(corpus), "train.on_nonfinite=maybe"],
                                      "on_nonfinite"),
        "config.json that is not JSON": (["--data", str(corpus)], "config.json is not readable"),
        "config.json that is not an object": (["--data", str(corpus)], "not a JSON object"),
        "workdir that is a file": (["--data", str(corpus)], "is a file"),
        "checkpoints that are not a folder": (["--data", str(corpus)], "is not a folder"),
        "HF folder with a broken tokenizer_config.json": (
            ["--data", str(corpus), "--tokenizer", str(broken_hf)], "tokenizer_config.json"),
        "no evaluation batches": (["--data", str(corpus), "train.eval_batches=0"],
                                  "train.eval_batches=0 is outside its valid range [1, inf)"),
        "unknown compute dtype": (["--data", str(corpus), "model.dtype=float8"], "bfloat16"),
        "negative loader workers": (["--data", str(corpus), "data.worker_count=-1"],
                                    "data.worker_count=-1"),
        "negative learning rate": (["--data", str(corpus), "optim.learning_rate=-1"],
                                   "[0, inf)"),
        "non-finite learning rate": (["--data", str(corpus), "optim.learning_rate=nan"],
                                     "finite"),
        "negative warmup": (["--data", str(corpus), "optim.warmup_steps=-5"], "[0, inf)"),
        "no checkpoints kept": (["--data", str(corpus), "train.keep_checkpoints=0"],
                                "train.keep_checkpoints=0"),
        "process count that is not a number": (["--data", str(corpus)], "JAX_NUM_PROCESSES"),
        "empty workdir name": ([], "empty path"),
        "fine-tuning for nan epochs": (["--task", "sst2", "--init", str(tmp), "--epochs", "nan"],
                                       "--epochs"),
        "GLUE sweep with no seeds": (["--init", str(tmp), "--seeds", "0"], "--seeds"),
        "eval of a damaged config.json": ([], "config.json is not readable"),
        "profile steps backwards": (["--data", str(corpus), "train.profile_steps=3:2"],
                                    "FIRST:LAST"),
        "every checkpoint unreadable": ([], "can be restored"),  # the trained run's data
        "coordinator without process count": (["--data", str(corpus)], "--num-processes"),
        "process id out of range": (["--data", str(corpus)], "--process-id 5"),
    }


# Cases whose command is not `run.py pretrain --workdir W ARGS`: (prefix, command) words.
COMMANDS = {
    "coordinator without process count": (["--coordinator", "localhost:1"], "pretrain"),
    "process id out of range": (["--coordinator", "localhost:1", "--num-processes", "2",
                                 "--process-id", "5"], "pretrain"),
    "fine-tuning for nan epochs": ([], "finetune"),
    "GLUE sweep with no seeds": ([], "glue"),
    "eval of a damaged config.json": ([], "eval"),
}
ENVIRONMENT = {"process count that is not a number": {"JAX_NUM_PROCESSES": "two"}}


CASES = ["missing corpus", "empty corpus", "vocab that does not parse",
         "tokenizer and model disagree", "sequence longer than positions",
         "batch not divisible by data axes", "unknown config key", "value of the wrong type",
         "unknown preset", "override without a section", "mesh that does not fit",
         "workdir of another run", "generator larger than discriminator", "BERT key for ELECTRA",
         "masking fractions over 1", "text that is not UTF-8", "TFDS dataset not prepared",
         "images of the wrong shape",
         "unknown non-finite policy", "config.json that is not JSON",
         "every checkpoint unreadable", "coordinator without process count",
         "process id out of range", "config.json that is not an object",
         "workdir that is a file", "checkpoints that are not a folder",
         "HF folder with a broken tokenizer_config.json", "no evaluation batches",
         "unknown compute dtype", "negative loader workers", "negative learning rate",
         "non-finite learning rate", "negative warmup", "no checkpoints kept",
         "process count that is not a number", "empty workdir name",
         "fine-tuning for nan epochs", "GLUE sweep with no seeds",
         "eval of a damaged config.json", "profile steps backwards"]


@pytest.fixture(scope="module")
def trained_workdir(tmp_path_factory) -> Path:
    """A finished 2-step run of the SMALL config (copied by cases that need a real workdir)."""
    tmp = tmp_path_factory.mktemp("trained")
    path = tmp / "corpus.txt"
    sentences = [f"Sentence {i} talks about topic {i % 7} and more words." for i in range(60)]
    path.write_text("\n\n".join("\n".join(sentences[i:i + 6]) for i in range(0, 60, 6)) + "\n")
    assert run.main(["pretrain", "--workdir", str(tmp / "run"), "--data", str(path),
                     *TRAINED, *SMALL]) == 0
    return tmp / "run"


def prepare_workdir(case: str, workdir: Path, trained: Path) -> None:
    """The existing workdir a case runs against: a folder with a note, or a copy of a real
    run (made unreadable where the case says so)."""
    if case == "every checkpoint unreadable":
        shutil.copytree(trained, workdir)
        for data_file in (workdir / "checkpoints").glob("*/state/ocdbt.process_0/d/*"):
            data_file.write_bytes(data_file.read_bytes()[:100])
        return
    if case == "workdir that is a file":
        workdir.write_text("keep me")
        return
    workdir.mkdir()
    (workdir / "notes.txt").write_text("keep me")
    if case == "checkpoints that are not a folder":
        (workdir / "checkpoints").write_text("keep me too")
    if case == "config.json that is not an object":
        (workdir / "config.json").write_text("[1, 2]")
    if case == "eval of a damaged config.json":
        (workdir / "config.json").write_text('{"method": "classify", ')
    if case == "workdir of another run":
        (workdir / "config.json").write_text(json.dumps(
            {"method": "bert", "model": {"hidden_size": 32}, "train": {}}))
    if case == "config.json that is not JSON":
        (workdir / "config.json").write_text("{not json")


def test_every_case_is_listed(tmp_path, corpus):
    assert sorted(bad_inputs(tmp_path, corpus)) == sorted(CASES)


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_and_leaves_workdir_alone(case, tmp_path, corpus, trained_workdir):
    """Each case as its own `run.py` process: exit status 2, exactly one line on stderr naming
    the fix (no traceback, no flood from background threads), the workdir unchanged."""
    workdir = tmp_path / "existing_workdir"
    prepare_workdir(case, workdir, trained_workdir)
    before = snapshot(workdir)
    args, hint = bad_inputs(tmp_path, corpus)[case]
    if case == "every checkpoint unreadable":
        args = ["--data", str(trained_workdir.parent / "corpus.txt"), *TRAINED]
    prefix, command = COMMANDS.get(case, ([], "pretrain"))
    size = SMALL[-2:] if "simclr_tiny" in args else SMALL  # no Transformer keys for images
    if command != "pretrain":
        size = []
    where = "" if case == "empty workdir name" else str(workdir)
    result = subprocess.run(
        [sys.executable, str(REPO / "run.py"), *prefix, command, "--workdir", where, *args,
         *size], capture_output=True, text=True, cwd=tmp_path, timeout=300,
        env={**os.environ, **ENVIRONMENT.get(case, {})})
    err = result.stderr.strip()
    assert result.returncode == 2, err[-2000:]
    assert err.startswith("error: ") and "\n" not in err, err[-2000:]
    assert hint in err, err
    assert snapshot(workdir) == before
    assert not list(tmp_path.glob("checkpoints")), "wrote into the current directory"


def test_cli_process_exit_code_and_no_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "run.py"), "pretrain", "--workdir", str(tmp_path / "w"),
         "--data", str(tmp_path / "missing.txt")],
        capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0 and "missing.txt" in result.stderr
    assert not (tmp_path / "w").exists()


def test_pretrain_on_a_prepared_tfds_dataset(tmp_path, capsys):
    """`--data tfds:NAME` with data.tfds_data_dir: ELECTRA trains on a TFDS text dataset prepared
    as ArrayRecord on disk (no TensorFlow, nothing downloaded)."""
    rng = np.random.default_rng(0)
    words = ["river", "city", "music", "season", "game", "film", "school", "team", "song",
             "line", "world", "station", "church", "family", "album", "band", "series"]
    texts = [" ".join(" ".join(rng.choice(words, 8)).capitalize() + "." for _ in range(6))
             for _ in range(40)]
    build_text_dataset(tmp_path / "tfds", "tiny_wiki", texts)
    workdir = tmp_path / "run"
    assert run.main(["pretrain", "--preset", "electra_tiny", "--data", "tfds:tiny_wiki",
                     "--workdir", str(workdir), f"data.tfds_data_dir={tmp_path / 'tfds'}",
                     "data.vocab_size=40", "data.held_out_fraction=0.2", "train.batch_size=8",
                     "model.embedding_size=16",
                     *SMALL]) == 0
    assert "finished step 2" in capsys.readouterr().out
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(row["loss"]) for row in rows if "loss" in row)


def test_help_everywhere(capsys):
    for command in ([], ["pretrain"], ["convert"], ["demo"], ["finetune"], ["eval"],
                    ["glue"], ["generate"], ["translate"]):
        with pytest.raises(SystemExit) as exit_info:
            run.main([*command, "--help"])
        assert exit_info.value.code == 0
        assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "message"), [
    (["pretrain", "--data", "{tmp}/nope.txt"], "--data {tmp}/nope.txt: no such file or folder"),
    (["translate", "--data", "en={tmp}/train.en,{tmp}/train.de", "--eval-data", "{tmp}/v.en"],
     "--data {tmp}/train.en: no such file or folder"),
    (["pretrain", "--tokenizer", "{tmp}/vocab.txt"], "--tokenizer {tmp}/vocab.txt: no such"),
    (["--import", "{tmp}/mine.py", "pretrain"], "--import {tmp}/mine.py: no such file"),
    (["finetune", "--task", "rte", "--init", "{tmp}/run"], "--init {tmp}/run: no such file"),
    (["finetune", "--task", "rte", "--init", "{tmp}", "--data", "{tmp}/glue"],
     "--data {tmp}/glue: no such folder; give the GLUE folder"),
    (["eval"], "--workdir {tmp}/w: no such file or folder; give the --workdir of a run.py "
               "finetune"),
])
def test_missing_paths_are_reported_before_jax_is_imported(args, message, tmp_path):
    """Under load, importing JAX and the methods takes seconds: a path that names nothing is
    refused before, in one line."""
    args = [arg.format(tmp=tmp_path) for arg in args]
    code = (f"import sys; from pretext_jax import run; "
            f"code = run.main({[*args, '--workdir', str(tmp_path / 'w')]!r}); "
            "print(code, 'jax' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.split() == ["2", "False"], result.stderr[-2000:]
    assert result.stderr.startswith(f"error: {message.format(tmp=tmp_path)}"), result.stderr
    assert result.stderr.count("\n") == 1


def test_a_plugin_that_raises_is_one_line_naming_its_file_and_line(tmp_path, capsys):
    plugin = tmp_path / "broken_objective.py"
    plugin.write_text("import json\n\n\ndef register():\n    raise ValueError('no such method')"
                      "\n\n\nregister()\n")
    assert run.main(["--import", str(plugin), "presets"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: --import {plugin} failed at {plugin}, line 5: ValueError: no such "
                   "method; fix the plugin (--traceback shows the whole traceback)")
    plugin.write_text("def broken(:\n")
    assert run.main(["--import", str(plugin), "presets"]) == 2
    assert f"failed at {plugin}, line 1: SyntaxError: " in capsys.readouterr().err


def test_glue_data_that_is_not_there_names_the_glue_folder_first(tmp_path):
    """`finetune` without --data reads TFDS; when that is not prepared the error leads with the
    usual way, the GLUE folder."""
    from pretext_jax.errors import UserError
    from pretext_jax.input_pipeline import glue

    with pytest.raises(UserError, match=r"^no GLUE data for rte: give --data GLUE_FOLDER \(the "
                                        r"GLUE root holding RTE/.*\), or prepare TFDS glue/rte "
                                        r"once with `tfds build glue/rte"):
        glue.read_glue("tfds", "rte", "train", data_dir=str(tmp_path))
