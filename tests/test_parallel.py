"""Parallel text (input_pipeline/parallel.py): line-aligned files and TSVs streamed as aligned
sentences, languages from suffixes, names or a header, and one-line errors for files that are
not aligned; the real Multi30K when it is there."""

from __future__ import annotations

from pathlib import Path

import pytest

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.parallel import open_parallel


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return path


def test_aligned_files_with_languages_from_suffixes_and_names(tmp_path):
    en = write(tmp_path / "train.en", ["A dog runs.", "  Two cats. ", ""])
    de = write(tmp_path / "train.de", ["Ein Hund rennt.", "Zwei Katzen.", ""])
    source = open_parallel(f"{en},{de}")
    assert source.languages == ("en", "de")
    pairs = [{"en": "A dog runs.", "de": "Ein Hund rennt."},
             {"en": "Two cats.", "de": "Zwei Katzen."}, {"en": "", "de": ""}]
    assert list(source) == pairs
    named = open_parallel(f"fr={write(tmp_path / 'a.txt', ['Un chien.'])},"
                          f"en={write(tmp_path / 'b.txt', ['A dog.'])}")
    assert named.languages == ("fr", "en") and list(named) == [{"fr": "Un chien.", "en": "A dog."}]
    assert list(source) == pairs  # every iteration reads the files again


def test_tsv_with_a_header_of_languages(tmp_path):
    path = write(tmp_path / "pairs.tsv", ["en\tde", "A dog.\tEin Hund.", "Cats.\tKatzen."])
    source = open_parallel(str(path))
    assert source.languages == ("en", "de") and source.is_tsv
    assert list(source) == [{"en": "A dog.", "de": "Ein Hund."}, {"en": "Cats.", "de": "Katzen."}]


def test_fingerprint_follows_the_files_and_languages(tmp_path):
    en = write(tmp_path / "x.en", ["a"])
    de = write(tmp_path / "x.de", ["b"])
    first = open_parallel(f"{en},{de}").fingerprint()
    assert open_parallel(f"{en},{de}").fingerprint() == first
    assert open_parallel(f"en={en},fr={de}").fingerprint() != first
    write(de, ["bb"])  # an edited file
    assert open_parallel(f"{en},{de}").fingerprint() != first


@pytest.mark.parametrize("case, message", [
    ("shorter", "parallel files must have the same number of lines, but train.en 3, train.de 2"),
    ("longer", "parallel files must have the same number of lines, but train.en 3, train.de 5"),
    ("one file", "a parallel corpus needs two or more line-aligned files"),
    ("no language", "cannot tell the language of"),
    ("twice", "names en more than once"),
    ("missing", "parallel corpus file"),
    ("tsv header", "must name its languages"),
    ("tsv columns", "line 3 has 1 tab-separated columns, not 2 (en, de)"),
    ("latin1", "train.de is not UTF-8 .byte 0xe4.; re-encode it"),
])
def test_bad_parallel_sources_are_one_line_errors(tmp_path, case, message):
    en = write(tmp_path / "train.en", ["a", "b", "c"])
    de_lines = {"shorter": ["a", "b"], "longer": ["a", "b", "c", "d", "e"]}.get(case,
                                                                              ["a", "b", "c"])
    de = write(tmp_path / "train.de", de_lines)
    spec = {"one file": str(en), "no language": f"{en},{write(tmp_path / 'x.txt', ['a'])}",
            "twice": f"{en},en={de}", "missing": f"{en},{tmp_path / 'nope.de'}",
            "tsv header": str(write(tmp_path / "p.tsv", ["English\tDeutsch words", "a\tb"])),
            "tsv columns": str(write(tmp_path / "q.tsv", ["en\tde", "a\tb", "c"])),
            }.get(case, f"{en},{de}")
    if case == "latin1":
        (tmp_path / "train.de").write_bytes("a\nb\xe4\nc\n".encode("latin1"))
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        list(open_parallel(spec))


def test_real_multi30k_is_aligned_in_three_languages(shared_data):
    """Multi30K (README: 29,000 training captions in English, German and French, line i of
    each translating line i of the others); val has 1,014, so pairing train with val fails."""
    root = shared_data / "multi30k"
    if not (root / "train.en").is_file():
        pytest.skip(f"{root} not found")
    files = [root / f"train.{lang}" for lang in ("en", "de", "fr")]
    source = open_parallel(",".join(map(str, files)))
    count = 0
    for count, row in enumerate(source, start=1):
        if count == 1:
            first = row
    assert count == 29000 and source.languages == ("en", "de", "fr")
    assert first == {lang: path.read_text(encoding="utf-8").splitlines()[0].strip()
                     for lang, path in zip(source.languages, files, strict=True)}
    with pytest.raises(UserError, match="train.en 29,000, val.de 1,014"):
        list(open_parallel(f"{root / 'train.en'},{root / 'val.de'}"))
