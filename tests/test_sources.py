"""Text sources: BERT's plain-text format, WikiText, TFDS datasets prepared on disk (never
downloaded), the demo corpus, errors."""

from __future__ import annotations

import json
import re

import pytest
from tfds_utils import build_text_dataset

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import sources

WIKITEXT_SAMPLE = """
 = Robert Boulter = 

 Robert Boulter is an English actor . He had a guest role in 2000 ? Yes !
 = = Career = = 

 In 2006 , Boulter starred alongside Whishaw in the play Citizenship written by Mark Ravenhill .
 = Du Fu = 

 Du Fu was a prominent Chinese poet of the Tang dynasty @-@ era . 
"""  # noqa: W291


def test_plain_text_documents(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("First sentence.\n  Second sentence.  \n\n\nOther document.\n\n")
    assert sources.read_plain_text(path) == [["First sentence.", "Second sentence."],
                                             ["Other document."]]
    second = tmp_path / "more.txt"
    second.write_text("Third document.\n")
    assert len(sources.read_documents(str(tmp_path / "*.txt"))) == 3
    assert len(sources.read_documents(str(tmp_path))) == 3


def test_wikitext_sample(tmp_path):
    path = tmp_path / "wiki.txt"
    path.write_text(WIKITEXT_SAMPLE)
    docs = sources.read_documents(str(path))  # auto-detected as WikiText
    assert docs == [
        ["Robert Boulter is an English actor .",
         "He had a guest role in 2000 ?", "Yes !",
         "In 2006 , Boulter starred alongside Whishaw in the play Citizenship written by "
         "Mark Ravenhill ."],
        ["Du Fu was a prominent Chinese poet of the Tang dynasty @-@ era ."],
    ]


def test_real_wikitext_valid(shared_data):
    path = shared_data / "wikitext-2" / "valid.txt"
    titles = sum(bool(re.match(r"^ = [^=].* = $", line))
                 for line in path.read_text().splitlines())
    docs = sources.read_documents(str(path))
    assert len(docs) == titles > 50
    assert not any(s.startswith("= ") for doc in docs for s in doc)
    assert sum(len(doc) for doc in docs) > 5000


def test_tfds_dataset_prepared_on_disk_is_read_by_name(tmp_path):
    """A TFDS text dataset prepared as ArrayRecord in data.tfds_data_dir: one document per
    record, paragraphs at newlines, then sentences; its description names dataset, version,
    split and size, the same for every opening."""
    texts = ["First sentence here. Second one follows!\nA new paragraph.", "Only one."]
    build_text_dataset(tmp_path, "tiny_corpus", texts)
    docs = sources.read_documents("tfds:tiny_corpus", data_dir=str(tmp_path))
    assert docs == [["First sentence here.", "Second one follows!", "A new paragraph."],
                    ["Only one."]]
    split = sources.open_tfds("tiny_corpus", "train", str(tmp_path))
    fields = json.loads(repr(split))
    assert fields["dataset"] == "tiny_corpus/1.0.0" and fields["data.tfds_split"] == "train"
    assert fields["examples"] == 2 and "0x" not in repr(split)
    assert repr(sources.open_tfds("tiny_corpus", "train", str(tmp_path))) == repr(split)
    assert len(sources.read_documents("tfds:tiny_corpus", tfds_split="train[:1]",
                                      data_dir=str(tmp_path))) == 1


def test_unprepared_tfds_dataset_names_the_build_command_and_never_downloads(tmp_path,
                                                                            monkeypatch):
    """Nothing that downloads or prepares is called: TFDS's own preparation, its GCS look-ups
    and `tfds.data_source` (which prepares what is missing) all fail here if they are."""
    tfds = pytest.importorskip("tensorflow_datasets")
    from tensorflow_datasets.core.utils import gcs_utils

    build_text_dataset(tmp_path, "tiny_corpus", ["One sentence."])

    def no_download(*args, **kwargs):
        raise AssertionError("pretext tried to download or prepare a dataset")

    monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", no_download)
    monkeypatch.setattr(tfds, "data_source", no_download)
    monkeypatch.setattr(tfds, "load", no_download)
    monkeypatch.setattr(gcs_utils, "gcs_dataset_info_files", no_download)
    monkeypatch.setattr(gcs_utils, "is_dataset_on_gcs", no_download)
    for name in ("mnist", "glue/sst2", "no_such_dataset_xyz"):  # registered ones too
        with pytest.raises(UserError) as error:
            sources.read_documents(f"tfds:{name}", data_dir=str(tmp_path))
        message = str(error.value)
        assert f"tfds build {name} --file_format=array_record --data_dir={tmp_path}`" in message
        assert "not prepared" in message and "\n" not in message
    with pytest.raises(UserError, match=r"no split 'validation' \(it has train\); set "
                                        "data.tfds_split"):
        sources.open_tfds("tiny_corpus", "validation", str(tmp_path))
    # Prepared in another format (tfds build's default, TFRecord): no random access.
    info = tmp_path / "tiny_corpus" / "1.0.0" / "dataset_info.json"
    info.write_text(info.read_text().replace('"array_record"', '"tfrecord"'))
    with pytest.raises(UserError, match="not stored as ArrayRecord.*--file_format=array_record"):
        sources.open_tfds("tiny_corpus", "train", str(tmp_path))


def test_python_docs_corpus_is_prose_and_is_parsed_once(tmp_path, monkeypatch):
    """The demo corpus is prose; the documents parsed once are kept in the cache folder and read
    back equal; a damaged cache file is parsed again and replaced."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    docs = sources.python_docs_documents()
    sentences = [s for doc in docs for s in doc]
    assert len(docs) > 300 and len(sentences) > 10000
    assert not any(s.startswith(">>>") for s in sentences)
    words = sum(len(s.split()) for s in sentences)
    assert words > 200_000
    [cache] = (tmp_path / "pretext-jax").iterdir()
    parses = []  # parsing again stands in for the standard library with one module
    monkeypatch.setattr(sources, "_stdlib_docstrings",
                        lambda: parses.append(1) or [["One module's docstring."]])
    assert sources.python_docs_documents() == docs and not parses  # read from the cache
    cache.write_text(cache.read_text()[:1000])  # a cut-off write
    reparsed = sources.python_docs_documents()
    assert parses == [1] and reparsed[-1] == ["One module's docstring."]
    assert sources.python_docs_documents() == reparsed and parses == [1]  # rewritten whole
    assert [p.name for p in cache.parent.iterdir()] == [cache.name]  # no temporary file left


def test_bad_sources(tmp_path):
    with pytest.raises(UserError, match="not found"):
        sources.read_documents(str(tmp_path / "missing.txt"))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n\n")
    with pytest.raises(UserError, match="empty"):
        sources.read_documents(str(empty))
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(UserError, match=r"latin1.txt is not UTF-8 \(bad byte at offset 3\)"):
        sources.read_documents(str(latin))
    with pytest.raises(UserError, match="no file matches"):
        sources.read_documents(str(tmp_path / "*.none"))
    with pytest.raises(UserError, match="text_format"):
        sources.read_documents(str(empty), text_format="xml")
    with pytest.raises(UserError, match="not prepared"):
        sources.read_documents("tfds:no_such_dataset_xyz", data_dir=str(tmp_path))
