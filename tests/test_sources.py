"""Text sources: BERT's plain-text format, WikiText, TFDS by name, the demo corpus, errors."""

from __future__ import annotations

import re

import pytest

from input_pipeline import sources
from input_pipeline.errors import UserError

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


def test_tfds_by_name_through_data_source(tmp_path):
    tfds = pytest.importorskip("tensorflow_datasets")
    with tfds.testing.mock_data(num_examples=7, policy=tfds.testing.MockPolicy.USE_CODE):
        docs = sources.read_documents("tfds:imdb_reviews", tfds_split="train",
                                      tfds_text_key="text")
    assert len(docs) == 7 and all(isinstance(s, str) for doc in docs for s in doc)


def test_python_docs_corpus_is_prose():
    docs = sources.python_docs_documents()
    sentences = [s for doc in docs for s in doc]
    assert len(docs) > 300 and len(sentences) > 10000
    assert not any(s.startswith(">>>") for s in sentences)
    words = sum(len(s.split()) for s in sentences)
    assert words > 200_000


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
    with pytest.raises(UserError, match="could not be opened"):
        sources.read_documents("tfds:no_such_dataset_xyz", data_dir=str(tmp_path))
