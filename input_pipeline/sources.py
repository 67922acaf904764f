"""Text sources for sentence-pair builders: a corpus is `list[list[str]]`, documents made of
non-empty sentences.

- Plain text, google-research/bert create_pretraining_data.py's input format: one sentence per
  line, blank lines between documents.
- WikiText (the tokenized release, e.g. wikitext-2/train.txt): one document per article.
- Any TFDS text dataset by name, read with `tfds.data_source` (ArrayRecord; no TensorFlow).
- The offline demo corpus: the reference topics in CPython's `pydoc_data`.
"""

from __future__ import annotations

import glob
import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from input_pipeline.errors import UserError

Documents = list[list[str]]
PathSpec = str | Path | Iterable[str | Path]
TEXT_FORMATS = ("auto", "plain", "wikitext")

# A sentence ends at . ? or ! (plus closing quotes/brackets) followed by whitespace and then a
# capital letter, digit, opening quote or bracket.
_SENTENCE_BREAK = re.compile(r"([.?!][\"'”’)\]]*)\s+(?=[\"'“‘(\[A-Z0-9])")
# ` = Title = `, ` = = Section = = `, ...: `=` groups of the same size around a title.
_WIKITEXT_HEADING = re.compile(r"((?:= )+)(\S.*?)((?: =)+)")
_WIKITEXT_SENTENCE_END = frozenset((".", "?", "!"))
_RULE_LINE = re.compile(r"[-=*~^#+]{3,}")
_LIST_MARKER = re.compile(r"(?:[*•-]|\d+\.|\[\d+\]|\(\d+\)) ")
_PROSE_START = re.compile(r"[A-Z*\"“‘(]")
_LIST_ITEM_START = re.compile(r"[A-Za-z*\"“‘(]")
_SENTENCE_END = re.compile(r"[.?!:][\"”’)]*$")
_UTF8_BOM = b"\xef\xbb\xbf"


def split_sentences(paragraph: str) -> list[str]:
    """Splits prose into sentences: after `.`, `?` or `!` (and any closing quotes/brackets) that
    is followed by whitespace and a capital, digit, opening quote or bracket. Whitespace is
    collapsed to single spaces. Simple by design: "Mr. Smith" is split, "e.g. this" is not."""
    text = " ".join(paragraph.split())
    return [s for s in _SENTENCE_BREAK.sub("\\1\n", text).split("\n") if s]


def _expand(spec: PathSpec) -> list[Path]:
    """Files named by a path, a glob, a folder (its `*.txt`, sorted) or a list of those."""
    items = [spec] if isinstance(spec, str | Path) else list(spec)
    paths: list[Path] = []
    for item in items:
        text = str(item)
        if Path(text).is_file():
            paths.append(Path(text))
        elif Path(text).is_dir():
            found = sorted(p for p in Path(text).glob("*.txt") if p.is_file())
            if not found:
                raise UserError(f"folder {text} has no *.txt files; point data.source at a "
                                "text file, a glob or a folder of .txt files")
            paths.extend(found)
        elif glob.has_magic(text):
            found = sorted(Path(p) for p in glob.glob(text, recursive=True) if Path(p).is_file())
            if not found:
                raise UserError(f"no file matches {text}; check the pattern given to --data "
                                "/ data.source")
            paths.extend(found)
        else:
            raise UserError(f"corpus {text} not found; check the path given to --data / "
                            "data.source")
    if not paths:
        raise UserError("no corpus files given; pass a text file, folder or glob to --data")
    return paths


def _read_lines(path: Path) -> list[str]:
    """Lines of a UTF-8 file (optional BOM; `\\n` or `\\r\\n` line ends)."""
    data = path.read_bytes()
    skip = len(_UTF8_BOM) if data.startswith(_UTF8_BOM) else 0
    try:
        text = data[skip:].decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 (bad byte at offset {e.start + skip}); re-encode "
                        f"it to UTF-8, e.g. iconv -f latin1 -t utf-8 {path.name}") from None
    return [line.rstrip("\r") for line in text.split("\n")]


def _non_empty(documents: Documents, name: str) -> Documents:
    documents = [d for d in documents if d]
    if not documents:
        raise UserError(f"corpus {name} has no text (no non-blank line); give files with one "
                        "sentence per line or WikiText articles")
    return documents


def _describe(spec: PathSpec) -> str:
    return str(spec) if isinstance(spec, str | Path) else ", ".join(map(str, spec))


def read_plain_text(paths: PathSpec) -> Documents:
    """google-research/bert create_pretraining_data.py's input: one sentence per line (stripped),
    blank lines between documents; each file also ends a document."""
    files = _expand(paths)
    documents: Documents = []
    for path in files:
        documents.append([])
        for line in _read_lines(path):
            line = line.strip()
            if line:
                documents[-1].append(line)
            elif documents[-1]:
                documents.append([])
    return _non_empty(documents, _describe(paths))


def _heading_level(line: str) -> int:
    """1 for ` = Title = `, 2 for ` = = Section = = `, ...; 0 for any other line."""
    match = _WIKITEXT_HEADING.fullmatch(line.strip())
    if not match or len(match.group(1)) != len(match.group(3)):
        return 0
    return len(match.group(1)) // 2


def _wikitext_sentences(line: str) -> list[str]:
    """A WikiText paragraph line split after the ` . `, ` ? ` and ` ! ` tokens."""
    sentences, current = [], []
    for token in line.split():
        current.append(token)
        if token in _WIKITEXT_SENTENCE_END:
            sentences.append(" ".join(current))
            current = []
    if current:
        sentences.append(" ".join(current))
    return sentences


def read_wikitext(paths: PathSpec) -> Documents:
    """The tokenized WikiText release (Merity et al. 2016): a document is an article, starting
    at a level-1 heading ` = Title = `; deeper headings (` = = Section = = `) are dropped; each
    paragraph line is split into sentences after ` . `, ` ? `, ` ! `. The text is otherwise
    kept as in the file: `@-@`, `@,@`, `<unk>` and the space-separated tokens stay."""
    documents: Documents = []
    for path in _expand(paths):
        documents.append([])
        for line in _read_lines(path):
            level = _heading_level(line)
            if level == 1:
                documents.append([])
            elif level == 0:
                documents[-1].extend(_wikitext_sentences(line))
    return _non_empty(documents, _describe(paths))


def _looks_like_wikitext(path: Path) -> bool:
    """True when the first non-blank line of the file is a ` = Heading = ` line."""
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                return _heading_level(line) > 0
    return False


def read_tfds(name: str, *, split: str = "train", text_key: str | None = None,
              data_dir: str | None = None) -> Documents:
    """One document per record of a TFDS dataset read through `tfds.data_source` (prepared as
    ArrayRecord). The text feature is `text_key`, else the record's only string feature. Every
    newline ends a paragraph, and paragraphs are split with `split_sentences`."""
    import tensorflow_datasets as tfds

    try:
        source = tfds.data_source(name, split=split, data_dir=data_dir)
    except Exception as e:  # tfds raises many types for unknown or unprepared datasets
        reason = (str(e).strip().splitlines() or [""])[0][:160]
        raise UserError(f"TFDS dataset {name} (split {split}) could not be opened "
                        f"({type(e).__name__}: {reason}); prepare it with `tfds build "
                        f"--file_format=array_record {name}` or set data.tfds_data_dir"
                        ) from None
    documents: Documents = []
    for index in range(len(source)):
        record = source[index]
        if text_key is None:
            keys = sorted(k for k, v in record.items() if isinstance(v, str | bytes))
            if len(keys) != 1:
                raise UserError(f"TFDS {name} records have string features {keys}; choose "
                                "one with data.tfds_text_key")
            text_key = keys[0]
        if text_key not in record:
            raise UserError(f"TFDS {name} records have no feature {text_key!r} (features: "
                            f"{', '.join(sorted(record))}); fix data.tfds_text_key")
        value = record[text_key]
        text = value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)
        documents.append([s for line in text.split("\n") for s in split_sentences(line)])
    return _non_empty(documents, f"tfds:{name}")


def read_documents(spec: str, *, text_format: str = "auto", tfds_split: str = "train",
                   tfds_text_key: str | None = None, data_dir: str | None = None) -> Documents:
    """The one entry point. `spec` is `tfds:NAME[/CONFIG]`, or a file, folder (its `*.txt`,
    sorted) or glob in `text_format`: `plain`, `wikitext`, or `auto` (WikiText when the first
    non-blank line of the first file is a ` = Heading = ` line, else plain)."""
    if spec.startswith("tfds:"):
        return read_tfds(spec.removeprefix("tfds:"), split=tfds_split, text_key=tfds_text_key,
                         data_dir=data_dir)
    if text_format not in TEXT_FORMATS:
        raise UserError(f"data.text_format={text_format!r} is unknown; use one of "
                        f"{', '.join(TEXT_FORMATS)}")
    paths = _expand(spec)
    if text_format == "auto":
        text_format = "wikitext" if _looks_like_wikitext(paths[0]) else "plain"
    return read_wikitext(paths) if text_format == "wikitext" else read_plain_text(paths)


def _prose_paragraph(lines: list[str]) -> str | None:
    """The text of a paragraph that reads as prose, without its list marker (`*`, `1.`, `[1]`);
    None for doctests, grammar rules, tables, underlined headings and code (which starts with a
    lowercase word or a symbol)."""
    stripped = [line.strip() for line in lines]
    if any(_RULE_LINE.fullmatch(line) or line.startswith((">>>", "|", "+-", "+="))
           for line in stripped):
        return None
    text = " ".join(stripped)
    marker = _LIST_MARKER.match(text)
    if marker:
        text = text[marker.end():]
    start = _LIST_ITEM_START if marker else _PROSE_START
    if "::=" in text or not start.match(text):
        return None
    return text


def _prose_sentences(text: str, min_words: int = 4) -> list[str]:
    """Sentences of the prose paragraphs (blank-line separated) of a documentation text that end
    with sentence punctuation and have at least `min_words` words."""
    sentences = []
    for paragraph in re.split(r"\n[ \t]*\n", text):
        prose = _prose_paragraph([line for line in paragraph.split("\n") if line.strip()])
        if prose:
            sentences.extend(s for s in split_sentences(prose)
                             if len(s.split()) >= min_words and _SENTENCE_END.search(s))
    return sentences


def python_docs_documents() -> Documents:
    """The offline demo corpus: English prose that ships with every CPython, the reference
    topics of `pydoc_data.topics` (about 80, 465 KB); one document per topic, in name order."""
    from pydoc_data.topics import topics

    documents = [_prose_sentences(topics[name]) for name in sorted(topics)]
    return [d for d in documents if d]


def split_documents(documents: Documents, held_out_fraction: float, seed: int
                    ) -> tuple[Documents, Documents]:
    """(train, held out): a seeded random `held_out_fraction` of the documents (at least one,
    and at least one left for training), each side in corpus order."""
    if not 0.0 < held_out_fraction < 1.0:
        raise UserError(f"held_out_fraction={held_out_fraction} must be in (0, 1); e.g. "
                        "data.held_out_fraction=0.05")
    if len(documents) < 2:
        raise UserError("the corpus has fewer than 2 documents, so none can be held out; give "
                        "more documents or set data.eval_source")
    count = min(max(1, round(len(documents) * held_out_fraction)), len(documents) - 1)
    held = set(np.random.default_rng(seed).permutation(len(documents))[:count].tolist())
    return ([d for i, d in enumerate(documents) if i not in held],
            [d for i, d in enumerate(documents) if i in held])
