"""Host-side preparation shared by the text methods: corpus -> tokenizer -> examples -> records.

The method supplies only its example builder (BERT: NSP pairs and masking). Prepared records are
cached under a fingerprint of everything that determines them, so a second run (or a resumed
one) reuses them and a change of corpus, tokenizer or example settings rebuilds them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from input_pipeline import sources, tokenizers
from input_pipeline.errors import UserError
from input_pipeline.records import RecordDirectory, write_records

DEMO_CORPUS = "python-docs"
# DataConfig fields that change how records are loaded, not what they contain.
LOADER_ONLY_FIELDS = ("cache_dir", "worker_count")

Documents = list[list[list[int]]]
ExampleBuilder = Callable[[Documents, Any, int], Iterable[dict[str, np.ndarray]]]


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the data comes from and how it is tokenised and loaded.

    `source`: a text file, folder or glob (plain one-sentence-per-line or WikiText format),
    `tfds:NAME[/CONFIG]` for any TFDS text dataset, or `python-docs` (the offline demo corpus that
    ships with CPython). `tokenizer`: a sentencepiece `.model`, a BERT `vocab.txt` or a HF BERT
    folder; empty = train a sentencepiece unigram model of `vocab_size` on the training split.
    `eval_source`: a separate held-out corpus (e.g. WikiText's valid split); empty = hold out
    `held_out_fraction` of the documents of `source`.
    """

    source: str = DEMO_CORPUS
    text_format: str = "auto"
    tfds_split: str = "train"
    tfds_text_key: str = ""
    tfds_data_dir: str = ""
    eval_source: str = ""
    tokenizer: str = ""
    vocab_size: int = 8000
    held_out_fraction: float = 0.05
    cache_dir: str = ""
    worker_count: int = 0


def source_fingerprint(spec: str) -> Any:
    """Paths with their sizes and mtimes (so edited files invalidate the cache); names as-is."""
    if spec == DEMO_CORPUS or spec.startswith("tfds:"):
        return spec
    paths = sorted(Path().glob(spec)) if any(c in spec for c in "*?[") else [Path(spec)]
    expanded = [q for p in paths for q in (sorted(p.rglob("*")) if p.is_dir() else [p])]
    return [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns]
            for p in expanded if p.is_file()]


def fingerprint(*parts: Any) -> str:
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def read_corpus(data: DataConfig, spec: str) -> list[list[str]]:
    if spec == DEMO_CORPUS:
        return sources.python_docs_documents()
    return sources.read_documents(
        spec, text_format=data.text_format, tfds_split=data.tfds_split,
        tfds_text_key=data.tfds_text_key or None, data_dir=data.tfds_data_dir or None,
    )


def tokenize_documents(documents: list[list[str]], tokenizer: Any) -> Documents:
    """Token ids per sentence; sentences that tokenise to nothing are dropped."""
    out = []
    for document in documents:
        ids = [ids for ids in (tokenizer.encode(s) for s in document) if ids]
        if ids:
            out.append(ids)
    return out


def prepare_text(
    data: DataConfig, build_examples: ExampleBuilder, example_settings: Any, cache_root: Path,
    seed: int, ordered: bool = False,
) -> tuple[RecordDirectory, RecordDirectory, Any]:
    """Returns (train records, held-out records, tokenizer), building what is not cached.
    `ordered` stores records in one shard, so record i is the i-th example built.

    The held-out split is made at document level before tokenizer training, so evaluation text
    is never seen by the tokenizer or the model.
    """
    if not 0.0 < data.held_out_fraction < 1.0:
        raise UserError(f"data.held_out_fraction={data.held_out_fraction} must be in (0, 1); "
                        "e.g. data.held_out_fraction=0.05")
    settings = {k: v for k, v in dataclasses.asdict(data).items()
                if k not in LOADER_ONLY_FIELDS}
    key = fingerprint(source_fingerprint(data.source), settings,
                      source_fingerprint(data.eval_source) if data.eval_source else "",
                      source_fingerprint(data.tokenizer) if data.tokenizer else "",
                      example_settings, seed)
    root = Path(cache_root) / key
    train_dir, eval_dir = root / "train", root / "eval"
    tokenizer_path = root / "tokenizer.model"
    if (train_dir / "features.json").is_file() and (eval_dir / "features.json").is_file():
        tokenizer = tokenizers.load_tokenizer(data.tokenizer or str(tokenizer_path))
        return RecordDirectory(train_dir), RecordDirectory(eval_dir), tokenizer
    documents = read_corpus(data, data.source)
    if data.eval_source:
        train_docs, eval_docs = documents, read_corpus(data, data.eval_source)
    else:
        train_docs, eval_docs = sources.split_documents(documents, data.held_out_fraction, seed)
    if data.tokenizer:
        tokenizer = tokenizers.load_tokenizer(data.tokenizer)
    else:
        root.mkdir(parents=True, exist_ok=True)
        sentences = (s for doc in train_docs for s in doc)
        tokenizer = tokenizers.SentencePieceTokenizer.train(
            sentences, root / "tokenizer", vocab_size=data.vocab_size)
    for docs, directory, split_seed in ((train_docs, train_dir, seed), (eval_docs, eval_dir,
                                                                         seed + 1)):
        examples = build_examples(tokenize_documents(docs, tokenizer), tokenizer, split_seed)
        write_records(examples, directory, metadata={"source": data.source},
                      num_shards=1 if ordered else 4)
    return RecordDirectory(train_dir), RecordDirectory(eval_dir), tokenizer
