"""The Quick start demos as a newcomer runs them, and the Markdown rows of what they print.

    python -m bench.demo_figures [--demos text,images,speech] [--data FSDD_RECORDINGS]
                                 [--workdir-root DIR] [--output FILE]

Runs each demo as its own `python run.py ...` process in a fresh workdir under
`--workdir-root` (so nothing resumes), timing the whole command from the outside (start-up,
data preparation, compilation, training, the untrained network's evaluation), and keeps the
summary lines it prints. The speech demo reads FSDD's recordings (`--data`, else
$PRETEXT_SHARED_DATA/fsdd/recordings or ../shared/data/fsdd/recordings) and is skipped, with a
note, when there are none. Writes a Markdown row per demo (`bench.report`): the demo, its printed
figures and wall-clock, the machine (with its load average when the demo started), the date
and the demo's command, printed and appended to `--markdown`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench import report
from bench.pretrain_wikitext import shared_data_dir
from pretext_jax import run

DEMOS = {  # name: (what it is, the arguments after `run.py`)
    "text": ("tiny BERT on the Python docs (`bert_tiny`)", ["demo"]),  # = `python run.py`
    "images": ("SimCLR on scikit-learn's digits (`simclr_digits`)", ["demo", "--images"]),
    "speech": ("CPC on FSDD (`cpc_digits`)", ["demo", "--speech", "--data"]),
}
TABLE = report.Table("demo_figures", ("demo", "printed figures", "wall-clock s"))


def figures(output: str) -> list[str]:
    """The summary a demo printed after its last step ("finished step ..." and the held-out
    figures), without the paths of its files; a line ending in ":" heads the next ones."""
    lines = output.splitlines()
    finished = max(i for i, line in enumerate(lines) if line.startswith("finished step"))
    kept: list[str] = []
    for line in lines[finished:]:
        if not line.strip() or " : " in line:  # "  checkpoints : PATH" and the like
            continue
        if kept and kept[-1].endswith(":"):
            kept[-1] += " " + line.strip()
        else:
            kept.append(line.strip())
    return kept


def run_demo(name: str, arguments: list[str], workdir: Path) -> dict[str, object]:
    """One demo in a fresh `workdir`: its printed figures, wall-clock and the machine."""
    shutil.rmtree(workdir, ignore_errors=True)
    command = [sys.executable, str(Path(run.__file__)), *arguments, "--workdir", str(workdir)]
    before = report.this_machine()
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{name} demo failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    shown = " ".join(["python run.py", *arguments]).replace(str(Path.cwd()) + os.sep, "")
    return {"demo": name, "figures": figures(done.stdout), "wall_clock_s": round(seconds),
            "machine": before, "command": shown}


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    """Runs the demos; writes (and returns) their rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demos", default="text,images,speech",
                        help=f"comma-separated, of {', '.join(DEMOS)}")
    parser.add_argument("--data", default="", help="FSDD's recordings/ folder (speech demo)")
    parser.add_argument("--workdir-root", default="runs/demo_figures")
    report.add_markdown_argument(parser, "demo_figures")
    args = parser.parse_args(argv)
    rows = []
    for name in args.demos.split(","):
        if name not in DEMOS:
            parser.error(f"unknown demo {name!r}; choose from {', '.join(DEMOS)}")
        arguments = list(DEMOS[name][1])
        if name == "speech":
            recordings = Path(args.data) if args.data else shared_data_dir() / "fsdd" / "recordings"
            if not recordings.is_dir():
                print(f"note: no FSDD recordings at {recordings}; the speech demo is skipped "
                      "(--data FOLDER)", file=sys.stderr)
                continue
            arguments.append(str(recordings))
        row = run_demo(name, arguments, Path(args.workdir_root) / name)
        report.write_row(TABLE, [DEMOS[name][0], "; ".join(row["figures"]),
                                 row["wall_clock_s"]], row["command"], args.markdown,
                         machine=row["machine"])
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
