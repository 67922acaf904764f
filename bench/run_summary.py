"""A `run.py` command, measured: the figures it prints and its wall-clock, as one Markdown row.

    python -m bench.run_summary [--markdown FILE] -- RUN_ARGS ...
    python -m bench.run_summary -- demo                  # the text demo (tiny BERT, Python docs)
    python -m bench.run_summary -- demo --images         # SimCLR on scikit-learn's digits
    python -m bench.run_summary -- demo --speech --data ../shared/data/fsdd/recordings
    python -m bench.run_summary -- pretrain --preset roberta_tiny --workdir runs/roberta

Runs `run.main(RUN_ARGS)` in this process, printing its output as it comes, and keeps what it
printed. The figures cell holds what a pre-training run (`demo`, `pretrain`) prints about its
held-out evaluation after "finished step N in S s" (the method's summary lines,
`Evaluation.summarize`, the lines README's quick start describes), without the lines naming files;
for any other command, the last line it printed (`finetune`: the dev metrics). Writes the row
of docs/benchmarks.md ("Demos and single CLI runs", `bench.report`); a command that fails
writes none.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
import time

from bench import report

TABLE = report.Table("run_summary", ("run.py command", "steps", "printed figures", "wall s"))
FILE_LINE = re.compile(r"^\s+(checkpoints|metrics|curves)\s+:")


class Tee(io.TextIOBase):
    """Writes to `stream` and keeps a copy."""

    def __init__(self, stream) -> None:
        self.stream, self.copy = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.stream.write(text)
        self.copy.write(text)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def printed_figures(output: str) -> tuple[int | None, str]:
    """(steps, figures) from what a run.py command printed (module docstring)."""
    lines = [line for line in output.splitlines() if line.strip()]
    finished = next((i for i, line in enumerate(lines) if line.startswith("finished step ")),
                    None)
    if finished is None:
        return None, lines[-1].strip() if lines else ""
    steps = int(lines[finished].split()[2])
    figures = ""
    for line in lines[finished + 1:]:
        if FILE_LINE.match(line):
            continue
        text = line.strip()
        figures += (" " if figures.endswith(":") else "; " if figures else "") + text
    return steps, figures


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    report.add_markdown_argument(parser, "run_summary")
    parser.add_argument("run_args", nargs=argparse.REMAINDER,
                        help="the run.py arguments, after --")
    args = parser.parse_args(argv)
    run_args = args.run_args[1:] if args.run_args[:1] == ["--"] else args.run_args
    if not run_args:
        parser.error("give the run.py command after --, e.g. -- demo --images")
    from pretext_jax import run

    tee = Tee(sys.stdout)
    start = time.perf_counter()
    with contextlib.redirect_stdout(tee):
        code = run.main(run_args)
    seconds = time.perf_counter() - start
    if code:
        raise SystemExit(f"run.py {' '.join(run_args)} exited with status {code}; no row written")
    steps, figures = printed_figures(tee.copy.getvalue())
    result = {"run": run_args, "steps": steps, "figures": figures, "wall_clock_s": seconds}
    report.write_row(TABLE, [f"run.py {' '.join(run_args)}", steps, figures, f"{seconds:.0f}"],
                     report.command_line("bench.run_summary", argv), args.markdown)
    return result


if __name__ == "__main__":
    main()
