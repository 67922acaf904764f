"""Text sources for sentence-pair builders: documents as lists of sentences.

- Plain text in create_pretraining_data.py's format: one sentence per line, blank line between
  documents.
- WikiText (the tokenized release): a document is an article, starting at a level-1 heading
  ` = Title = `; sub-headings are dropped; each paragraph line is split into sentences after
  ` . `, ` ? `, ` ! ` tokens. `@-@`, `<unk>` and the like are kept as they are.
- Any TFDS text dataset prepared as ArrayRecord (`tfds build NAME --file_format=array_record`),
  read from its files (no TensorFlow, never a download: `tfds_builder`).
- The offline demo corpus: the English documentation in CPython's `pydoc_data`.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pretext_jax.errors import UserError, require
from pretext_jax.input_pipeline.descriptions import describe

Documents = list[list[str]]

_WIKITEXT_TITLE = re.compile(r"^ = [^=].* = $")
_WIKITEXT_HEADING = re.compile(r"^ (= )+.*( =)+ $")
_WIKITEXT_SENTENCE_END = re.compile(r"(?<= [.?!]) ")
_PROSE_SENTENCE_END = re.compile(r"(?<=[.?!])\s+(?=[\"'(\[A-Z0-9])")


def split_sentences(paragraph: str) -> list[str]:
    """Splits prose after . ? ! followed by whitespace and a capital, digit, quote or bracket."""
    return [s.strip() for s in _PROSE_SENTENCE_END.split(" ".join(paragraph.split()))
            if s.strip()]


def expand_paths(spec: str | Path | Iterable[str | Path]) -> list[Path]:
    """The files of a corpus: a file, a folder's `*.txt` files, or a glob (absolute or
    relative, `**` recursive), sorted; a path that exists is taken as it is even if its name
    holds glob characters."""
    specs = [spec] if isinstance(spec, str | Path) else list(spec)
    paths: list[Path] = []
    for item in specs:
        text = str(item)
        found = text_files(text)
        if not found and _is_glob(text):
            raise UserError(f"no file matches {text}; check the pattern in data.source")
        if not found and Path(text).is_dir():
            raise UserError(f"folder {text} has no *.txt files; point data.source at a file")
        if not found:
            raise UserError(f"corpus {text} not found; check the path given to --data / "
                            "data.source")
        paths.extend(found)
    return paths


def _is_glob(text: str) -> bool:
    return any(c in text for c in "*?[") and not Path(text).exists()


def text_files(text: str) -> list[Path]:
    """The files a corpus path names, sorted: a glob's matches, a folder's `*.txt` files, the
    file itself; none when there are none (`expand_paths` says why)."""
    if _is_glob(text):
        return [Path(m) for m in sorted(glob.glob(text, recursive=True))]
    if Path(text).is_dir():
        return sorted(Path(text).glob("*.txt"))
    return [Path(text)] if Path(text).is_file() else []


def _read_lines(path: Path) -> list[str]:
    data = path.read_bytes()
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 (bad byte at offset {e.start}); re-encode it, "
                        f"e.g. iconv -f latin1 -t utf-8 {path.name}") from None


def _non_empty(documents: Documents, name: str) -> Documents:
    documents = [d for d in documents if d]
    if not documents:
        raise UserError(f"corpus {name} is empty (no non-blank text); give a file with text")
    return documents


def plain_text_documents(lines: Iterable[str]) -> Iterator[list[str]]:
    """One sentence per line, blank lines between documents (create_pretraining_data.py)."""
    document: list[str] = []
    for line in lines:
        line = line.strip()
        if line:
            document.append(line)
        elif document:
            yield document
            document = []
    if document:
        yield document


def wikitext_documents(lines: Iterable[str]) -> Iterator[list[str]]:
    """WikiText lines: articles at level-1 headings, paragraphs split into sentences."""
    document: list[str] = []
    for line in lines:
        if _WIKITEXT_TITLE.match(line):
            if document:
                yield document
            document = []
        elif not (_WIKITEXT_HEADING.match(line) or not line.strip()):
            document.extend(s.strip() for s in _WIKITEXT_SENTENCE_END.split(line) if s.strip())
    if document:
        yield document


def read_plain_text(spec: str | Path | Iterable[str | Path]) -> Documents:
    """All documents of plain-text files (`plain_text_documents`), file by file."""
    return _non_empty([d for path in expand_paths(spec) for d in plain_text_documents(
        _read_lines(path))], str(spec))


def read_wikitext(spec: str | Path | Iterable[str | Path]) -> Documents:
    """All documents of WikiText files (`wikitext_documents`), file by file."""
    return _non_empty([d for path in expand_paths(spec) for d in wikitext_documents(
        _read_lines(path))], str(spec))


def looks_like_wikitext(path: Path) -> bool:
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                return bool(_WIKITEXT_HEADING.match(line.rstrip("\n")))
    return False


def tfds_data_dir(data_dir: str | None) -> str:
    """Where TFDS datasets are read from: `data_dir`, else $TFDS_DATA_DIR, else
    ~/tensorflow_datasets."""
    require("tensorflow_datasets", "tfds", "reading TFDS datasets")
    from tensorflow_datasets.core import constants

    return str(Path(data_dir or constants.DATA_DIR).expanduser())


def tfds_builder(name: str, data_dir: str | None) -> Any:
    """The prepared TFDS dataset `NAME[/CONFIG][:VERSION]` in `data_dir` (`tfds_data_dir`),
    opened from its files alone (`dataset_info.json`, `features.json`;
    `read_only_builder.builder_from_files`), never through its builder code, so nothing is
    downloaded or generated. A dataset that is not there is a UserError naming the command that
    prepares it."""
    where = tfds_data_dir(data_dir)
    from tensorflow_datasets.core import read_only_builder, registered

    try:
        return read_only_builder.builder_from_files(name, data_dir=where)
    except registered.DatasetNotFoundError:
        raise UserError(f"TFDS dataset {name} is not prepared in {where} (pretext never "
                        f"downloads); prepare it once with `tfds build {name} "
                        f"--file_format=array_record --data_dir={where}` or set "
                        "data.tfds_data_dir to where it is") from None
    except (ValueError, OSError) as e:  # a malformed name, or the dataset in two places
        raise UserError(f"TFDS dataset {name} in {where} cannot be opened "
                        f"({str(e).splitlines()[0][:160]}); check the name in data.source and "
                        "data.tfds_data_dir") from None


def tfds_fingerprint(builder: Any) -> dict[str, str]:
    """What identifies a prepared TFDS dataset's records: its full name (with config and
    version) and a digest of its `dataset_info.json` (splits, shard lengths, sizes)."""
    info = (builder.data_path / "dataset_info.json").read_bytes()
    return {"dataset": builder.info.full_name, "dataset_info": hashlib.sha1(info).hexdigest()[:16]}


class TfdsSplit:
    """One split of a prepared TFDS dataset: its records by index (ArrayRecord through
    `as_data_source`, decoded to numpy without TensorFlow), and as `repr` a stable description
    of them (`descriptions.describe`: dataset, version, split, count)."""

    def __init__(self, name: str, records: Any, fields: dict[str, Any]):
        self.name, self.records, self.fields = name, records, fields

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.records[index]

    def __repr__(self) -> str:
        return describe("TFDS split", **self.fields)


def open_tfds(name: str, split: str, data_dir: str | None) -> TfdsSplit:
    """Random access to a split of a prepared TFDS dataset (`tfds_builder`), or a one-line
    UserError that says how to prepare it."""
    builder = tfds_builder(name, data_dir)
    try:
        records = builder.as_data_source(split=split)
    except NotImplementedError:
        where = tfds_data_dir(data_dir)
        raise UserError(f"TFDS dataset {name} in {where} is not stored as ArrayRecord (no "
                        f"random access); prepare it again with `tfds build {name} "
                        f"--file_format=array_record --data_dir={where}`") from None
    except (ValueError, KeyError):
        raise UserError(f"TFDS dataset {name} has no split {split!r} (it has "
                        f"{', '.join(sorted(builder.info.splits))}); set data.tfds_split"
                        ) from None
    return TfdsSplit(name, records, {**tfds_fingerprint(builder), "data.tfds_split": split,
                                     "examples": len(records)})


def tfds_text_key(record: dict[str, Any], name: str, text_key: str | None) -> str:
    """The record's text feature: `text_key`, or its only string feature."""
    if text_key:
        if text_key not in record:
            raise UserError(f"TFDS {name} records have no feature {text_key!r} (they have "
                            f"{sorted(record)}); fix data.tfds_text_key")
        return text_key
    keys = [k for k, v in record.items() if isinstance(v, str | bytes)]
    if len(keys) != 1:
        raise UserError(f"TFDS {name} records have string features {keys}; choose one "
                        "with data.tfds_text_key")
    return keys[0]


def tfds_document(record: dict[str, Any], key: str) -> list[str]:
    """A record's text as a document: paragraphs at newlines, then sentences."""
    value = record[key]
    text = value.decode("utf-8") if isinstance(value, bytes) else str(value)
    return [s for para in text.split("\n") for s in split_sentences(para)]


def read_tfds(name: str, *, split: str = "train", text_key: str | None = None,
              data_dir: str | None = None) -> Documents:
    """Each record's text feature becomes a document (`tfds_document`). Needs the dataset
    prepared as ArrayRecord (`tfds build NAME --file_format=array_record`)."""
    source = open_tfds(name, split, data_dir)
    documents: Documents = []
    for index in range(len(source)):
        record = source[index]
        text_key = tfds_text_key(record, name, text_key)
        documents.append(tfds_document(record, text_key))
    return _non_empty(documents, f"tfds:{name}")


def read_documents(spec: str, *, text_format: str = "auto", tfds_split: str = "train",
                   tfds_text_key: str | None = None, data_dir: str | None = None) -> Documents:
    """The one entry point: `tfds:NAME[/CONFIG]`, or a file/folder/glob in `text_format`
    (`plain`, `wikitext`, or `auto`: WikiText when the first text line is a ` = Heading = `)."""
    if spec.startswith("tfds:"):
        return read_tfds(spec[5:], split=tfds_split, text_key=tfds_text_key, data_dir=data_dir)
    if text_format not in ("auto", "plain", "wikitext"):
        raise UserError(f"data.text_format={text_format!r} is unknown; use auto, plain or "
                        "wikitext")
    paths = expand_paths(spec)
    if text_format == "auto":
        text_format = "wikitext" if looks_like_wikitext(paths[0]) else "plain"
    return read_wikitext(paths) if text_format == "wikitext" else read_plain_text(paths)


def _prose_sentences(text: str) -> list[str]:
    """Sentences of documentation text: code (indented or `>>>`) and rule lines dropped."""
    sentences = []
    for paragraph in re.split(r"\n\s*\n", text):
        lines = [ln for ln in paragraph.splitlines()
                 if ln.strip() and not ln.startswith(" " * 3)
                 and not ln.lstrip().startswith((">>>", "..."))
                 and not re.fullmatch(r"\s*[-=*~^#]+\s*", ln)]
        sentences.extend(s for s in split_sentences(" ".join(lines)) if len(s.split()) >= 4)
    return sentences


def _stdlib_docstrings() -> Iterable[list[str]]:
    """Docstrings of the standard library's modules, read with `ast` (nothing is imported)."""
    import ast
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo", "ensurepip"}
    for path in sorted(root.rglob("*.py")):
        if skip & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        texts = [ast.get_docstring(node) for node in ast.walk(tree) if isinstance(
            node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)]
        yield [s for text in texts if text for s in _prose_sentences(text)]


def python_docs_documents() -> Documents:
    """The offline demo corpus, English prose that ships with every CPython: the reference
    topics of `pydoc_data` (one document per topic) and the docstrings of the standard library
    (one document per module); about 2 MB of text.

    Parsing the standard library takes seconds, so the documents are kept in the user's cache
    folder (`$XDG_CACHE_HOME` or ~/.cache, `pretext-jax/`) under a name keyed by this Python's
    build and standard library; an unwritable or damaged cache only means parsing again."""
    import sysconfig

    build = f"{sys.version}|{sysconfig.get_paths()['stdlib']}|{_DEMO_CORPUS_FORMAT}"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pretext-jax" / (
        f"python-docs-{hashlib.sha256(build.encode()).hexdigest()[:16]}.json")
    try:
        return json.loads(cache.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    from pydoc_data.topics import topics

    documents = [_prose_sentences(topics[name]) for name in sorted(topics)]
    documents.extend(_stdlib_docstrings())
    documents = [d for d in documents if d]
    try:  # written whole or not at all: a temporary file renamed over the name
        cache.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=cache.parent,
                                         suffix=".tmp", delete=False) as handle:
            try:
                json.dump(documents, handle)
            except OSError:
                Path(handle.name).unlink()
                raise
        os.replace(handle.name, cache)
    except OSError:
        pass
    return documents


# Bumped when `_prose_sentences` or the files read change, so no older cache is read.
_DEMO_CORPUS_FORMAT = 1
