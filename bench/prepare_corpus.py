"""Corpus-scale preparation benchmark: MB of text per second per core, peak resident memory of
the whole process tree, records and bytes written, and the speed-up from 1 to 2 workers.

    python -m bench.prepare_corpus --sizes 100 1024 --workers 1 2 --methods bert electra

The corpus is WikiText-2's training text (10.8 MB, `../shared/data` or $PRETEXT_SHARED_DATA)
repeated until it reaches each size, every copy with its articles in a new random order and the
words of every paragraph line shuffled (headings kept), so a tokenizer never sees one text many
times and documents keep WikiText's article structure. It is written once to
`--out/corpus-<size>MB.txt` and reused. A sentencepiece tokenizer (16,000 pieces, the most
WikiText-2 supports) is trained once on WikiText-2 and given to every run, so the runs time the
preparation itself. Each run is `run.py prepare` in a fresh cache with BERT's settings
(`bert_base`: seq 128, 20 predictions, dupe_factor 10, static masking) or ELECTRA's
(`electra_small`: seq 128, 19 predictions, dynamic masking, so records are stored unmasked).
Prints one JSON line per run and writes its Markdown row of docs/benchmarks.md ("Text preparation
at corpus scale", `bench.report`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench import report

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("PRETEXT_SHARED_DATA", REPO.parent / "shared" / "data"))
PRESETS = {
    "bert": ("bert_base", ["examples.max_seq_length=128", "examples.max_predictions_per_seq=20",
                           "examples.dupe_factor=10", "examples.dynamic_masking=false"]),
    "electra": ("electra_small", ["examples.max_seq_length=128",
                                  "examples.max_predictions_per_seq=19"]),
}
TABLE = report.Table("prepare_corpus", (
    "method (preset)", "corpus MB", "workers", "seconds", "MB/s per core",
    "peak RSS of the process tree, MB", "training records", "written MB"))


def markdown_cells(row: dict) -> list:
    return [f"{row['method']} (`{PRESETS[row['method']][0]}`)", f"{row['corpus_mb']:.0f}",
            row["workers"], f"{row['seconds']:.1f}", f"{row['mb_per_s_per_core']:.2f}",
            f"{row['peak_rss_mb']:,}", f"{row['train_records']:,}",
            f"{row['bytes_written_mb']:,.0f}"]


def build_corpus(source: Path, size_mb: int, out: Path) -> Path:
    """WikiText-2 copies with shuffled article order and shuffled words per line (see the
    module docstring), up to `size_mb` MB."""
    path = out / f"corpus-{size_mb}MB.txt"
    if path.is_file() and path.stat().st_size >= size_mb * 2**20:
        return path
    lines = source.read_text(encoding="utf-8").splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(" = ") and
              not line.startswith(" = = ")]
    articles = [lines[a:b] for a, b in zip(starts, [*starts[1:], len(lines)], strict=True)]
    rng = np.random.default_rng(0)
    written = 0
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        while written < size_mb * 2**20:
            for index in rng.permutation(len(articles)):
                for line in articles[index]:
                    if line.strip() and not line.startswith(" = "):
                        words = line.split()
                        line = " " + " ".join(words[i] for i in rng.permutation(len(words)))
                    text = line + "\n"
                    handle.write(text)
                    written += len(text.encode("utf-8"))
                if written >= size_mb * 2**20:
                    break
    tmp.replace(path)
    return path


def train_tokenizer(source: Path, out: Path) -> Path:
    from pretext_jax.input_pipeline import sources, tokenizers

    model = out / "wikitext2-16k.model"
    if not model.is_file():
        sentences = (s for d in sources.read_documents(str(source)) for s in d)
        tokenizers.SentencePieceTokenizer.train(sentences, out / "wikitext2-16k",
                                                vocab_size=16000)
    return model


def tree_rss_mb(root: int) -> float:
    """Resident memory of a process and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, []))
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


def run(method: str, corpus: Path, tokenizer: Path, workers: int, workdir: Path) -> dict:
    preset, overrides = PRESETS[method]
    shutil.rmtree(workdir, ignore_errors=True)
    command = [sys.executable, str(REPO / "run.py"), "prepare", "--preset", preset, "--data",
               str(corpus), "--tokenizer", str(tokenizer), "--workdir", str(workdir),
               f"data.prepare_workers={workers}", *overrides]
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "JAX_PLATFORMS": "cpu"})
    peak = 0.0
    while process.poll() is None:
        peak = max(peak, tree_rss_mb(process.pid))
        time.sleep(0.2)
    seconds = time.perf_counter() - start
    out, err = process.communicate()
    if process.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{err[-3000:]}")
    summary = next(line for line in out.splitlines() if line.startswith("prepared "))
    files = list((workdir / "data").rglob("*.array_record"))
    index = json.loads(next((workdir / "data").glob("*/*/train/features.json")).read_text())
    size_mb = corpus.stat().st_size / 2**20
    return {"method": method, "corpus_mb": round(size_mb, 1), "workers": workers,
            "seconds": round(seconds, 1),
            "mb_per_s_per_core": round(size_mb / seconds / workers, 3),
            "peak_rss_mb": round(peak), "train_records": index["count"],
            "bytes_written_mb": round(sum(f.stat().st_size for f in files) / 2**20, 1),
            "summary": summary}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1024],
                        help="corpus sizes in MB")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--methods", nargs="+", default=["bert", "electra"],
                        choices=sorted(PRESETS))
    parser.add_argument("--only", nargs="*", default=[],
                        help="run only these METHOD:SIZE:WORKERS combinations")
    parser.add_argument("--out", default="runs/bench_prepare", help="corpora, tokenizer, runs")
    parser.add_argument("--json", help="append one JSON line per run to this file")
    report.add_markdown_argument(parser, "prepare_corpus")
    args = parser.parse_args(argv)
    source = SHARED / "wikitext-2" / "train.txt"
    if not source.is_file():
        raise SystemExit(f"WikiText-2 not found at {source}; set PRETEXT_SHARED_DATA")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(source, out)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"date {time.strftime('%Y-%m-%d')}")
    for size in args.sizes:
        corpus = build_corpus(source, size, out)
        for method in args.methods:
            for workers in args.workers:
                if args.only and f"{method}:{size}:{workers}" not in args.only:
                    continue
                row = run(method, corpus, tokenizer, workers, out / "run")
                print(json.dumps(row), flush=True)
                if args.json:
                    with open(args.json, "a") as handle:
                        handle.write(json.dumps(row) + "\n")
                report.write_row(TABLE, markdown_cells(row),
                                 report.command_line("bench.prepare_corpus", argv),
                                 args.markdown, devices=False)
    shutil.rmtree(out / "run", ignore_errors=True)


if __name__ == "__main__":
    main()
