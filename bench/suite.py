"""The test suite, measured: the command `.ci/run` calls, its counts and its time, as one
Markdown row of docs/testing.md.

    python -m bench.suite [--markdown FILE] [-- EXTRA_PYTEST_ARGS ...]

Runs `python -m pytest tests -q -n 2 --dist loadfile --durations=30` (plus any extra
arguments) in the checkout with this Python, streaming its output, and reads pytest's closing
summary line ("1084 passed, 2 skipped in 2349.12s (0:39:09)"): the count of each outcome and
pytest's own seconds, beside the wall-clock of the whole command. The compilation cache
(`tests/conftest.py`) makes a second run faster than the first; say which one a row is. A run
whose summary line cannot be read writes no row.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

from bench import report

REPO = Path(__file__).resolve().parent.parent
COMMAND = ["-m", "pytest", "tests", "-q", "-n", "2", "--dist", "loadfile",
           "--durations=30"]
OUTCOMES = ("passed", "failed", "errors", "skipped", "xfailed", "xpassed")
TABLE = report.Table("suite", ("tests", *OUTCOMES, "pytest s", "wall s"))


def parse_summary(line: str) -> dict[str, float] | None:
    """{outcome: count, ..., "seconds": pytest's time} from pytest's summary line, or None
    when `line` is not one. "error" is counted as "errors"; warnings are not outcomes."""
    seconds = re.search(r" in ([0-9.]+)s\b", line)
    counts = re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)\b", line)
    if not seconds or not counts:
        return None
    summary = {outcome: 0 for outcome in OUTCOMES}
    for count, outcome in counts:
        summary["errors" if outcome.startswith("error") else outcome] += int(count)
    return {**summary, "seconds": float(seconds.group(1))}


def markdown_cells(summary: dict[str, float], wall_s: float) -> list:
    return [f"{sum(summary[o] for o in OUTCOMES):,}", *(f"{summary[o]:,}" for o in OUTCOMES),
            f"{summary['seconds']:,.0f}", f"{wall_s:,.0f}"]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    report.add_markdown_argument(parser, "suite")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER,
                        help="extra pytest arguments, after --")
    args = parser.parse_args(argv)
    extra = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, *COMMAND, *extra], cwd=REPO, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    summary = None
    for line in process.stdout:
        print(line, end="", flush=True)
        summary = parse_summary(line.strip(" =\n")) or summary
    process.wait()
    wall_s = time.perf_counter() - start
    if summary is None:
        raise SystemExit(f"pytest exited with status {process.returncode} and no summary line; "
                         "no row written")
    report.write_row(TABLE, markdown_cells(summary, wall_s),
                     report.command_line("bench.suite", argv), args.markdown,
                     devices=False)
    return {**summary, "wall_clock_s": wall_s, "returncode": process.returncode}


if __name__ == "__main__":
    main()
