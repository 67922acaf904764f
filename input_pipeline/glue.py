"""GLUE fine-tuning data: five tasks read from the `glue_data` TSV files or from TFDS, and
BERT's or XLNet's sentence(-pair) encoding.

Tasks (Wang et al. 2019, "GLUE: A Multi-Task Benchmark and Analysis Platform for NLU"): SST-2
and CoLA (single sentences), MRPC and RTE (sentence pairs) are classification; STS-B (pairs) is
regression on a 0-5 similarity score. The TSV layout is the one GLUE's `download_glue_data.py`
writes: tab-separated, no quoting (quotes are ordinary characters), a header row except in CoLA.
Label ids: the files' "0"/"1" become 0/1, as in the CoLA and MRPC processors of
google-research/bert run_classifier.py; RTE's `entailment`/`not_entailment` become 0/1, the
order of the TFDS `glue/rte` labels. These are the ids TFDS `glue` stores for all four tasks, so
both readers agree.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.corpus import source_fingerprint
from pretext_jax.input_pipeline.sources import (
    open_tfds,
    tfds_builder,
    tfds_data_dir,
    tfds_fingerprint,
)
from pretext_jax.input_pipeline.tokenizers import Tokenizer


@dataclass(frozen=True)
class GlueTask:
    """One GLUE task: where its files live, how their columns are laid out, its labels and the
    metrics GLUE reports for it.

    `columns` names every TSV column; `has_header` says whether the first row repeats those
    names. `labels` is None for regression (STS-B), whose label is a float in `score_range`.
    `main_metric` is the key of `objectives.common.glue_metrics.task_metrics` used to pick the best
    checkpoint; for tasks with two metrics (MRPC, STS-B) it is `glue_score`, their unweighted
    mean, which is how the GLUE paper and leaderboard score such a task, so model selection
    optimises the number GLUE ranks by rather than one of its two halves.
    """

    name: str
    folder: str
    tfds_name: str
    columns: tuple[str, ...]
    has_header: bool
    text_a_column: int
    text_b_column: int | None
    label_column: int
    tfds_text_a: str
    tfds_text_b: str | None
    labels: tuple[str, ...] | None
    metrics: tuple[str, ...]
    main_metric: str
    score_range: tuple[float, float] | None = None

    @property
    def is_regression(self) -> bool:
        return self.labels is None

    @property
    def is_pair(self) -> bool:
        return self.text_b_column is not None

    @property
    def num_labels(self) -> int:
        """Output units of the classifier head: 1 for regression."""
        return 1 if self.labels is None else len(self.labels)


GLUE_TASKS: dict[str, GlueTask] = {
    "sst2": GlueTask(
        name="sst2", folder="SST-2", tfds_name="glue/sst2", columns=("sentence", "label"),
        has_header=True, text_a_column=0, text_b_column=None, label_column=1,
        tfds_text_a="sentence", tfds_text_b=None, labels=("0", "1"), metrics=("accuracy",),
        main_metric="accuracy"),
    "cola": GlueTask(
        name="cola", folder="CoLA", tfds_name="glue/cola",
        columns=("source", "label", "original_annotation", "sentence"), has_header=False,
        text_a_column=3, text_b_column=None, label_column=1, tfds_text_a="sentence",
        tfds_text_b=None, labels=("0", "1"), metrics=("matthews_corrcoef",),
        main_metric="matthews_corrcoef"),
    "mrpc": GlueTask(
        name="mrpc", folder="MRPC", tfds_name="glue/mrpc",
        columns=("Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"), has_header=True,
        text_a_column=3, text_b_column=4, label_column=0, tfds_text_a="sentence1",
        tfds_text_b="sentence2", labels=("0", "1"), metrics=("f1", "accuracy"),
        main_metric="glue_score"),
    "rte": GlueTask(
        name="rte", folder="RTE", tfds_name="glue/rte",
        columns=("index", "sentence1", "sentence2", "label"), has_header=True, text_a_column=1,
        text_b_column=2, label_column=3, tfds_text_a="sentence1", tfds_text_b="sentence2",
        labels=("entailment", "not_entailment"), metrics=("accuracy",), main_metric="accuracy"),
    "stsb": GlueTask(
        name="stsb", folder="STS-B", tfds_name="glue/stsb",
        columns=("index", "genre", "filename", "year", "old_index", "source1", "source2",
                 "sentence1", "sentence2", "score"),
        has_header=True, text_a_column=7, text_b_column=8, label_column=9,
        tfds_text_a="sentence1", tfds_text_b="sentence2", labels=None,
        metrics=("pearson", "spearman"), main_metric="glue_score", score_range=(0.0, 5.0)),
}


def _key(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


def glue_task(name: str | GlueTask) -> GlueTask:
    """The task for a name such as `sst2`, `SST-2` or `STS-B` (case-insensitive)."""
    if isinstance(name, GlueTask):
        return name
    task = GLUE_TASKS.get(_key(name))
    if task is None:
        valid = ", ".join(f"{t.name} ({t.folder})" for t in GLUE_TASKS.values())
        raise UserError(f"unknown GLUE task {name!r}; use one of {valid}")
    return task


@dataclass
class GlueSplit:
    """Raw examples of one split: texts and labels (int32 class ids or float32 scores)."""

    texts_a: list[str]
    texts_b: list[str] | None
    labels: np.ndarray


def _tsv_split(split: str) -> str:
    if split in ("train", "dev", "validation"):
        return "dev" if split == "validation" else split
    if split == "test":
        raise UserError("GLUE test labels are hidden (the test split is scored on "
                        "gluebenchmark.com); evaluate on split dev")
    raise UserError(f"GLUE split {split!r} is unknown; use train or dev")


def _tsv_path(folder: Path, task: GlueTask, split: str) -> Path:
    """`<folder>/<Task>/<split>.tsv` in a GLUE root, else `<folder>/<split>.tsv` when `folder`
    is the task folder itself."""
    inner = folder / task.folder / f"{split}.tsv"
    own = folder / f"{split}.tsv"
    if inner.is_file() or not (own.is_file() or _key(folder.name) == _key(task.folder)):
        return inner
    return own


def _parse_label(task: GlueTask, value: str, where: str) -> int | float:
    if task.labels is not None:
        if value not in task.labels:
            raise UserError(f"{where}: label {value!r} is not one of {', '.join(task.labels)}; "
                            f"fix the row or check that this is the {task.folder} file")
        return task.labels.index(value)
    try:
        score = float(value)
    except ValueError:
        score = float("nan")
    low, high = task.score_range or (-np.inf, np.inf)
    if not low <= score <= high:
        raise UserError(f"{where}: score {value!r} is not a number in [{low}, {high}]; fix the "
                        f"row or check that this is the {task.folder} file")
    return score


def read_glue_tsv(folder: str | Path, task: str | GlueTask, split: str) -> GlueSplit:
    """Reads `<folder>/<Task>/{train,dev}.tsv` (or `<folder>/{train,dev}.tsv` when `folder` is
    the task folder), splitting on tabs with no quote handling (csv.QUOTE_NONE), as the
    processors of google-research/bert run_classifier.py do."""
    task = glue_task(task)
    path = _tsv_path(Path(folder), task, _tsv_split(split))
    if not path.is_file():
        raise UserError(f"GLUE file {path} not found; point at the GLUE root (holding "
                        f"{task.folder}/) or at the {task.folder} folder, as written by GLUE's "
                        "download_glue_data.py")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise UserError(f"{path} line {line} is not UTF-8 (bad byte at offset {e.start}); "
                        "re-encode the file as UTF-8 or download it again") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    first = 1 if task.has_header else 0
    if task.has_header and lines:
        header = tuple(lines[0].rstrip("\r").split("\t"))
        if header != task.columns:
            raise UserError(f"{path} line 1: header {' | '.join(header)!r} is not "
                            f"{' | '.join(task.columns)!r}; check that this is the "
                            f"{task.folder} file")
    texts_a: list[str] = []
    texts_b: list[str] | None = [] if task.is_pair else None
    labels: list[int | float] = []
    for number, line in enumerate(lines[first:], start=first + 1):
        row = line.rstrip("\r").split("\t")
        where = f"{path} line {number}"
        if len(row) != len(task.columns):
            raise UserError(f"{where} has {len(row)} tab-separated columns, not "
                            f"{len(task.columns)} ({', '.join(task.columns)}); fix the row (no "
                            "tabs or newlines inside a text) or download the file again")
        labels.append(_parse_label(task, row[task.label_column], where))
        texts_a.append(row[task.text_a_column])
        if texts_b is not None:
            texts_b.append(row[task.text_b_column])
    if not labels:
        raise UserError(f"{path} has no data rows; download the {task.folder} files again")
    dtype = np.float32 if task.is_regression else np.int32
    return GlueSplit(texts_a, texts_b, np.asarray(labels, dtype))


def _text(value: object) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def read_glue_tfds(task: str | GlueTask, split: str, data_dir: str | None = None,
                   name: str | None = None) -> GlueSplit:
    """Reads a prepared TFDS `glue/<config>` (ArrayRecord, `sources.open_tfds`: from its files,
    never downloaded). `split` is a TFDS split (`train`, `validation`, slices such as
    `train[:10%]`); `dev` means `validation`. `name` overrides the dataset name (default
    `task.tfds_name`)."""
    task = glue_task(task)
    name = name or task.tfds_name
    tfds_split = "validation" if split == "dev" else split
    source = open_tfds(name, tfds_split, data_dir)
    texts_a: list[str] = []
    texts_b: list[str] | None = [] if task.is_pair else None
    labels: list[int | float] = []
    for index in range(len(source)):
        record = source[index]
        label = record["label"]
        if float(label) == -1:
            raise UserError(f"TFDS {name} split {tfds_split} has label -1 (GLUE test labels are "
                            "hidden); fine-tune on train and evaluate on validation")
        labels.append(float(label) if task.is_regression else int(label))
        texts_a.append(_text(record[task.tfds_text_a]))
        if texts_b is not None:
            texts_b.append(_text(record[task.tfds_text_b]))
    if not labels:
        raise UserError(f"TFDS {name} split {tfds_split} is empty; check the split name")
    dtype = np.float32 if task.is_regression else np.int32
    return GlueSplit(texts_a, texts_b, np.asarray(labels, dtype))


def _tfds_name(spec: str, task: GlueTask) -> str | None:
    """The TFDS dataset `spec` names for `task` (`tfds`, `tfds:glue`: the task's config), or
    None for a folder of TSV files."""
    if spec != "tfds" and not spec.startswith("tfds:"):
        return None
    name = spec[5:] or task.tfds_name
    if name == "glue":
        return task.tfds_name
    if name.startswith("glue/") and name != task.tfds_name:
        raise UserError(f"{spec} is not the TFDS config of GLUE task {task.name}; use "
                        f"tfds:{task.tfds_name} or just tfds")
    return name


def read_glue(spec: str | Path, task: str | GlueTask, split: str,
              data_dir: str | None = None) -> GlueSplit:
    """The one entry point: `tfds` or `tfds:glue` (the task's `glue/<config>`), `tfds:NAME` (a
    TFDS dataset with GLUE's features; a `glue/` config must be the task's), or a folder of GLUE
    TSV files (the GLUE root or the task folder)."""
    task = glue_task(task)
    name = _tfds_name(str(spec), task)
    if name is None:
        return read_glue_tsv(spec, task, split)
    _check_tfds_prepared(task, name, data_dir)
    return read_glue_tfds(task, split, data_dir, name=name)


def _check_tfds_prepared(task: GlueTask, name: str, data_dir: str | None) -> None:
    """Refuses TFDS GLUE data that is not there (TFDS not installed, or `name` not prepared),
    naming the GLUE folder first: the usual way to give the data."""
    installed = importlib.util.find_spec("tensorflow_datasets") is not None
    where = tfds_data_dir(data_dir) if installed else "~/tensorflow_datasets"
    if installed and (Path(where) / name.split(":")[0]).is_dir():
        return
    raise UserError(f"no GLUE data for {task.name}: give --data GLUE_FOLDER (the GLUE root "
                    f"holding {task.folder}/, as download_glue_data.py writes it), or prepare "
                    f"TFDS {name} once with `tfds build {name} --file_format=array_record "
                    f"--data_dir={where}`{'' if installed else ' (pip install pretext-jax[tfds])'}"
                    " and set data.tfds_data_dir if elsewhere; pretext never downloads")


def glue_fingerprint(spec: str, task: str | GlueTask, data_dir: str | None = None) -> Any:
    """What a task's training records are read from, for cache keys: its `train.tsv`'s path,
    size and mtime (not the rest of the GLUE root: other tasks' files, or a cache kept there,
    leave it alone), or the TFDS dataset's name, version and info digest."""
    task = glue_task(task)
    name = _tfds_name(spec, task)
    if name is None:
        return source_fingerprint(str(_tsv_path(Path(spec), task, "train")))
    return tfds_fingerprint(tfds_builder(name, data_dir))


def truncate_seq_pair(tokens_a: list[int], tokens_b: list[int], max_length: int) -> None:
    """Shortens the pair in place to at most `max_length` tokens in total, one token at a time
    from the end of the longer sequence (`tokens_b` on ties), as `_truncate_seq_pair` in
    google-research/bert run_classifier.py and zihangdai/xlnet classifier_utils.py do."""
    while len(tokens_a) + len(tokens_b) > max_length:
        longer = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        longer.pop()


# Input layouts: BERT's `[CLS] A [SEP] B [SEP]`, padded on the right; RoBERTa's `<s> A </s></s>
# B </s>` (fairseq `sentence_prediction`: each sentence between <s>/</s>, a pair joined by a
# second </s>; HF `RobertaTokenizer.build_inputs_with_special_tokens`), token types all 0,
# padded on the right (MPNet's fine-tuning reads it too); XLNet's `A <sep> B <sep> <cls>`,
# padded on the left; XLM's `</s> A </s> B </s>` (facebookresearch/XLM glue.py: each sentence
# between </s>, a pair joined by `concat_batches` on the shared </s>), padded on the right.
LAYOUTS = ("bert", "roberta", "xlnet", "xlm")
# zihangdai/xlnet classifier_utils.py segment ids of XLNet's <cls> and of padding.
SEG_ID_CLS, SEG_ID_PAD = 2, 4


def with_specials(tokens_a: list[int], tokens_b: list[int] | None, tokenizer: Tokenizer,
                   layout: str) -> tuple[list[int], list[int]]:
    """(ids, token types) of one example: A and its separator type 0, B and its separator type
    1; BERT puts [CLS] (type 0) first, XLNet <cls> (type `SEG_ID_CLS`) last, XLM </s> (the
    tokenizer's `eos_id`, type 0) first; RoBERTa [CLS] (<s>) first, a second separator before B
    and every type 0 (its one token type)."""
    if layout == "roberta":
        ids = [tokenizer.cls_id, *tokens_a, tokenizer.sep_id]
        if tokens_b is not None:
            ids += [tokenizer.sep_id, *tokens_b, tokenizer.sep_id]
        return ids, [0] * len(ids)
    ids, types = [*tokens_a, tokenizer.sep_id], [0] * (len(tokens_a) + 1)
    if tokens_b is not None:
        ids += [*tokens_b, tokenizer.sep_id]
        types += [1] * (len(tokens_b) + 1)
    if layout in ("bert", "xlm"):
        return [tokenizer.cls_id if layout == "bert" else tokenizer.eos_id, *ids], [0, *types]
    return [*ids, tokenizer.cls_id], [*types, SEG_ID_CLS]


def special_count(layout: str, pair: bool) -> int:
    """How many special tokens `with_specials` adds to one sentence or a pair."""
    if not pair:
        return 2
    return 4 if layout == "roberta" else 3


def encode_glue(split: GlueSplit, tokenizer: Tokenizer, max_seq_length: int,
                layout: str = "bert") -> dict[str, np.ndarray]:
    """`convert_single_example` of google-research/bert run_classifier.py (`layout="bert"`):
    `[CLS] A [SEP]` with token type 0, then `B [SEP]` with type 1 for pairs, padded on the right;
    or of zihangdai/xlnet classifier_utils.py (`layout="xlnet"`): `A <sep>` type 0, `B <sep>`
    type 1, `<cls>` type 2, padded on the left with segment id 4; or of facebookresearch/XLM
    glue.py (`layout="xlm"`): `</s> A </s> B </s>`, padded on the right; or fairseq's RoBERTa
    (`layout="roberta"`): `<s> A </s></s> B </s>`, types 0. An empty B is left out (as
    `if example.text_b` there does); the pair is truncated longest-first (`truncate_seq_pair`).
    Padding uses `pad_id` (XLNet's TF code pads with id 0, which the mask hides just the same).
    Returns int32 `input_ids`, `token_type_ids`, `attention_mask` (1 = real token; the TF
    XLNet `input_mask` is its complement) of shape [N, max_seq_length] and `label` (int32 ids
    or float32 scores)."""
    if layout not in LAYOUTS:
        raise UserError(f"examples.layout={layout!r} is unknown; use one of {LAYOUTS}")
    specials = special_count(layout, split.texts_b is not None)
    if max_seq_length < specials:
        raise UserError(f"max_seq_length={max_seq_length} is shorter than the {specials} "
                        "special tokens (CLS and SEP) of a GLUE example; use at least "
                        f"{specials} (BERT and XLNet fine-tune with 128)")
    count = len(split.texts_a)
    input_ids = np.full((count, max_seq_length), tokenizer.pad_id, np.int32)
    token_type_ids = np.full((count, max_seq_length), SEG_ID_PAD if layout == "xlnet" else 0,
                             np.int32)
    attention_mask = np.zeros((count, max_seq_length), np.int32)
    for row, text_a in enumerate(split.texts_a):
        tokens_a = list(tokenizer.encode(text_a))
        text_b = split.texts_b[row] if split.texts_b is not None else ""
        tokens_b = None
        if text_b:
            tokens_b = list(tokenizer.encode(text_b))
            truncate_seq_pair(tokens_a, tokens_b, max_seq_length - specials)
        else:
            del tokens_a[max_seq_length - 2:]
        ids, types = with_specials(tokens_a, tokens_b, tokenizer, layout)
        span = (slice(max_seq_length - len(ids), None) if layout == "xlnet"
                else slice(0, len(ids)))
        input_ids[row, span] = ids
        token_type_ids[row, span] = types
        attention_mask[row, span] = 1
    return {"input_ids": input_ids, "token_type_ids": token_type_ids,
            "attention_mask": attention_mask, "label": np.asarray(split.labels)}
