"""README and docs/: the README stays short and has one method-table row per registered method,
every relative link (and anchor) in README.md, CHANGELOG.md and docs/ resolves, and every table
of figures in docs/benchmarks.md and docs/testing.md has the header that its `bench/` script
writes (`bench/report.py`), so that each figure there is a row a command wrote. Also the shared
row formatter and the parsers of `bench.suite` and `bench.run_summary`."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from bench import report, run_summary, suite
from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.objectives import registry

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = sorted([README, REPO / "CHANGELOG.md", *(REPO / "docs").rglob("*.md")])
FIGURE_PAGES = (REPO / "docs" / "benchmarks.md", REPO / "docs" / "testing.md")
MAX_README_LINES = 320

LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
CODE_SPAN = re.compile(r"`[^`\n]*`")
MARKER = re.compile(r"^<!-- bench: (\S+)( results\.md)? -->$")
CELL_SEPARATOR = re.compile(r"(?<!\\)\|")


def prose(text: str) -> str:
    """The text without fenced code blocks and code spans (which may hold brackets)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file: lower case, punctuation dropped, spaces
    to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).replace("`", "").lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in CELL_SEPARATOR.split(line.strip())[1:-1]]


def method_table_names(text: str) -> list[str]:
    """The method names in the first column of README's method table."""
    header = next(i for i, line in enumerate(text.splitlines())
                  if line.startswith("| method | modality | paper |"))
    names = []
    for line in text.splitlines()[header + 2:]:
        if not line.startswith("|"):
            break
        names.append(cells(line)[0].strip("`"))
    return names


def tables(path: Path) -> list[tuple[str | None, list[str]]]:
    """Each Markdown table of `path` as (the `<!-- bench: ... -->` marker on the line before
    it, or None; its lines)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        if lines[i].startswith("|"):
            start = i
            while i < len(lines) and lines[i].startswith("|"):
                i += 1
            marker = lines[start - 1] if start else ""
            found.append((marker if MARKER.match(marker) else None, lines[start:i]))
        i += 1
    return found


# ---------------------------------------------------------------------------------- README
def test_readme_is_short():
    count = len(README.read_text(encoding="utf-8").splitlines())
    assert count <= MAX_README_LINES, f"README.md has {count} lines; keep it to {MAX_README_LINES}"


def built_in_methods() -> list[str]:
    """The methods the package registers (not those a test's plugin file added to this
    process): those whose loss is defined in `pretext_jax.objectives`."""
    return [name for name in registry.names() if getattr(
        registry.get(name).loss, "func", registry.get(name).loss).__module__.startswith(
        "pretext_jax.objectives.")]


def test_readme_method_table_has_one_row_per_registered_method():
    names, built_in = method_table_names(README.read_text(encoding="utf-8")), built_in_methods()
    assert len(names) == len(set(names)), f"repeated rows: {names}"
    assert sorted(names) == built_in, (
        f"missing rows: {sorted(set(built_in) - set(names))}; "
        f"rows of no registered method: {sorted(set(names) - set(built_in))}")


def test_readme_method_table_names_each_methods_presets():
    text = README.read_text(encoding="utf-8")
    rows = {cells(line)[0].strip("`"): cells(line)[3] for line in text.splitlines()
            if line.startswith("| `") and len(cells(line)) == 7}
    for name in built_in_methods():
        missing = [p for p in registry.get(name).presets if f"`{p}`" not in rows[name]]
        assert not missing, f"README's row of {name} lacks the presets {missing}"


def test_method_table_reader_sees_a_missing_row():
    text = README.read_text(encoding="utf-8")
    dropped = "\n".join(line for line in text.splitlines() if not line.startswith("| `cpc` |"))
    assert "cpc" not in method_table_names(dropped)


# ---------------------------------------------------------------------------------- links
@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target} (no {resolved})")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading #{anchor} in {resolved.name})")
    assert not broken, f"{page.relative_to(REPO)}: broken links {broken}"


def test_link_check_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n[a](missing.md) [b](#title) [c](#nowhere) `[d](x.md)`\n")
    targets = LINK.findall(prose(page.read_text()))
    assert targets == ["missing.md", "#title", "#nowhere"]
    assert anchors(page) == {"title"}


def test_anchors_follow_github():
    page = REPO / "docs" / "methods" / "masked_lm.md"
    assert {"bert", "ernie-10", "how-the-text-examples-are-built"} <= anchors(page)


# ---------------------------------------------------------------------------------- figures
def bench_tables() -> dict[str, report.Table]:
    """Every `bench/` module's `TABLE`, by module name, and each of its `TABLES` (one per task
    of the module), by table name."""
    found = {}
    for path in sorted((REPO / "bench").glob("*.py")):
        module = importlib.import_module(f"bench.{path.stem}")
        if isinstance(getattr(module, "TABLE", None), report.Table):
            found[path.stem] = module.TABLE
        found.update({table.name: table for table in getattr(module, "TABLES", ())})
    return found


def test_every_table_of_figures_has_its_scripts_header():
    known = bench_tables()
    shown = set()
    for page in FIGURE_PAGES:
        for marker, lines in tables(page):
            where = f"{page.name}: table {lines[0][:60]}..."
            assert marker, f"{where} has no <!-- bench: SCRIPT --> line naming its script"
            name, results = MARKER.match(marker).groups()
            assert name in known, f"{where}: no bench/{name}.py with a TABLE"
            if results:  # the fine-tuning table `bench.glue` prints (pretrain.finetune.glue_table)
                assert re.fullmatch(r"\| task \| metric \|.* \| majority class \|", lines[0]), where
                width = len(cells(lines[0]))
            else:
                assert "\n".join(lines[:2]) == known[name].header(), where
                width = len(known[name].all_columns)
                shown.add(name)
            bad = [line[:80] for line in lines[2:] if len(cells(line)) != width]
            assert not bad, f"{where}: rows without {width} cells: {bad}"
    assert shown == set(known), f"bench tables not shown in docs: {sorted(set(known) - shown)}"


# ---------------------------------------------------------------------------------- formatter
def test_row_format():
    table = report.Table("demo", ("what", "accuracy"))
    assert table.header() == ("| what | accuracy | machine | date | command |\n"
                              "| --- | --- | --- | --- | --- |")
    row = table.row(["a|b\nc", 0.12345], "python -m bench.demo x|y", machine="m", date="d")
    assert row == "| a\\|b c | 0.123 | m | d | `python -m bench.demo x\\|y` |"
    assert len(cells(row)) == len(table.all_columns)
    assert table.row([None, 3], "c", machine="m", date="d") == "| - | 3 | m | d | `c` |"
    with pytest.raises(ValueError, match="1 cells"):
        table.row(["only one"], "c")


def test_figures_command_and_machine():
    assert report.figures({"loss": 4.7213, "accuracy": 0.3, "steps": 5}) == (
        "accuracy 0.300, loss 4.721, steps 5")
    command = report.command_line("bench.x", ["--a", "b c", "k=v"])
    assert command == "python -m bench.x --a 'b c' k=v"
    machine = report.this_machine(devices=False)
    assert "-core" in machine and "GiB" in machine and "load" in machine and "jax" not in machine


def test_write_row_appends_under_one_header(tmp_path, capsys):
    table, path = report.Table("demo", ("x",)), tmp_path / "sub" / "rows.md"
    first = report.write_row(table, [1], "cmd 1", path, devices=False)
    report.write_row(table, [2], "cmd 2", path, devices=False, machine="m", date="2000-01-01")
    lines = path.read_text().splitlines()
    assert "\n".join(lines[:2]) == table.header() and lines[2] == first
    assert lines[3] == "| 2 | m | 2000-01-01 | `cmd 2` |" and len(lines) == 4
    assert capsys.readouterr().out.splitlines() == lines[2:]
    assert report.write_row(table, [3], "c", None, devices=False).startswith("| 3 |")


def test_suite_reads_pytests_summary_line():
    summary = suite.parse_summary("1 failed, 1083 passed, 2 skipped, 1 xfailed, 3 warnings, "
                                  "1 error in 1459.20s (0:24:19)")
    assert summary == {"passed": 1083, "failed": 1, "errors": 1, "skipped": 2, "xfailed": 1,
                       "xpassed": 0, "seconds": 1459.2}
    assert suite.parse_summary("collected 1084 items") is None
    assert suite.markdown_cells(summary, 1500.4)[:3] == ["1,088", "1,083", "1"]


def test_run_summary_keeps_the_printed_figures():
    output = ("prepared\n\nfinished step 600 in 117 s\n  checkpoints : runs/demo/checkpoints\n"
              "  metrics     : runs/demo/metrics.jsonl\n"
              "  held-out MLM accuracy 0.103 vs majority-token baseline 0.043\n"
              "  held-out linear probe on frozen features (mean over time):\n"
              "    digit: 0.880 trained vs 0.513 untrained vs 0.827 MFCC\n")
    assert run_summary.printed_figures(output) == (600, (
        "held-out MLM accuracy 0.103 vs majority-token baseline 0.043; held-out linear probe on "
        "frozen features (mean over time): digit: 0.880 trained vs 0.513 untrained vs 0.827 MFCC"))
    assert run_summary.printed_figures("x\nsst2 dev after 3 steps: accuracy 0.5\n") == (
        None, "sst2 dev after 3 steps: accuracy 0.5")
