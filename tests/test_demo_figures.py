"""`bench.demo_figures` runs each demo as the README's command in a fresh workdir and turns what
it printed into a Markdown row (the demo itself is stubbed here; tests/test_demo.py runs it)."""

from __future__ import annotations

import subprocess

from bench import demo_figures

PRINTED = """\
[eval @ step 200] loss=9.7 knn_accuracy=0.95

finished step 200 in 150 s
  checkpoints : runs/x/checkpoints
  held-out loss: 9.721
  held-out kNN accuracy of the backbone's features 0.950 vs 0.897 for the same network untrained
"""


def test_demo_figures_runs_the_demo_and_writes_its_row(tmp_path, monkeypatch, capsys):
    commands = []

    def fake_run(command, **kwargs):
        commands.append(command)
        return subprocess.CompletedProcess(command, 0, stdout=PRINTED, stderr="")

    monkeypatch.setattr(demo_figures.subprocess, "run", fake_run)
    stale = tmp_path / "images" / "checkpoints"
    stale.mkdir(parents=True)  # an earlier run's: removed, so that nothing resumes
    output = tmp_path / "rows.md"
    rows = demo_figures.main(["--demos", "images", "--workdir-root", str(tmp_path),
                              "--markdown", str(output)])
    assert commands[0][2:] == ["demo", "--images", "--workdir", str(tmp_path / "images")]
    assert not stale.exists()
    assert rows[0]["figures"] == [
        "finished step 200 in 150 s", "held-out loss: 9.721",
        "held-out kNN accuracy of the backbone's features 0.950 vs 0.897 for the same network "
        "untrained"]
    row = capsys.readouterr().out.strip()
    assert output.read_text() == demo_figures.TABLE.header() + "\n" + row + "\n"
    assert row.startswith("| SimCLR on scikit-learn's digits (`simclr_digits`) | finished step "
                          "200 in 150 s; held-out loss: 9.721; held-out kNN accuracy")
    assert "-core" in row and "load" in row and row.endswith(
        "| `python run.py demo --images` |")


def test_figures_keep_the_summary_without_paths_and_join_headings():
    printed = ("[eval @ step 500] loss=0.67\n\nfinished step 500 in 450 s\n"
               "  checkpoints : runs/s/checkpoints\n  metrics     : runs/s/metrics.jsonl\n"
               "  held-out loss: 0.674\n"
               "  held-out linear probe on frozen features (mean over time):\n"
               "    digit: 0.880 trained vs 0.513 untrained vs 0.827 MFCC\n"
               "    speaker: 0.997 trained vs 0.880 untrained vs 0.970 MFCC\n")
    assert demo_figures.figures(printed) == [
        "finished step 500 in 450 s", "held-out loss: 0.674",
        "held-out linear probe on frozen features (mean over time): digit: 0.880 trained vs "
        "0.513 untrained vs 0.827 MFCC", "speaker: 0.997 trained vs 0.880 untrained vs 0.970 MFCC"]
