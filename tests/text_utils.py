"""Token documents for the example builders' tests: every token id unique, so a token says which
document and place it came from; and the made-up parallel sentences of the XLM and Unicoder
tests; the GLUE files of the fine-tuning tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def unique_token_documents(first: int, stride: int, lengths: tuple[int, int],
                           count: int = 60, sentences: int = 8) -> list[list[list[int]]]:
    """`count` documents of `sentences` sentences of `lengths[0]`..`lengths[1]` tokens (seed 0);
    document d's ids count up from `first + stride * d`, so they increase along it."""
    rng = np.random.default_rng(0)
    out = []
    for d in range(count):
        ids = iter(range(first + stride * d, first + stride * (d + 1)))
        out.append([[next(ids) for _ in range(int(rng.integers(lengths[0], lengths[1] + 1)))]
                    for _ in range(sentences)])
    return out


# Two made-up languages with one grammar: "en" words and their "de" translations.
WORDS = {"en": ["the", "cat", "dog", "bird", "sees", "likes", "big", "small", "red", "blue",
                "and", "house", "tree", "runs", "to", "a"],
         "de": ["der", "katze", "hund", "vogel", "sieht", "mag", "gross", "klein", "rot",
                "blau", "und", "haus", "baum", "rennt", "zum", "ein"]}


def sentences(count: int, seed: int) -> list[tuple[str, str]]:
    """(en, de) pairs: adjective subject verb object, word for word."""
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(count):
        picks = [int(rng.integers(6, 10)), int(rng.integers(1, 4)), int(rng.integers(4, 6)),
                 int(rng.choice([1, 2, 3, 11, 12]))]
        pairs.append(tuple(" ".join(WORDS[lang][i] for i in picks) for lang in ("en", "de")))
    return pairs


def labelled_sentences(rng: np.random.Generator, count: int, words: list[str]
                       ) -> tuple[list[str], np.ndarray]:
    """Filler sentences of six of `words[2:]` plus "good" (label 1) or "bad" (label 0),
    shuffled; `words` starts with "good", "bad"."""
    texts, labels = [], rng.integers(0, 2, count)
    for label in labels:
        sentence = [*rng.choice(words[2:], 6), "good" if label else "bad"]
        rng.shuffle(sentence)
        texts.append(" ".join(sentence))
    return texts, labels


def write_glue_folder(root: Path, words: list[str], sst2: tuple[int, int],
                      stsb: tuple[int, int]) -> str:
    """SST-2 and STS-B in GLUE's file layout under `root`, (train, dev) rows each, from
    `labelled_sentences` (seed 0)."""
    rng = np.random.default_rng(0)
    (root / "SST-2").mkdir()
    for split, count in zip(("train", "dev"), sst2, strict=True):
        texts, labels = labelled_sentences(rng, count, words)
        rows = [f"{t}\t{y}" for t, y in zip(texts, labels, strict=True)]
        (root / "SST-2" / f"{split}.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    (root / "STS-B").mkdir()
    header = "\t".join(["index", "genre", "filename", "year", "old_index", "source1", "source2",
                        "sentence1", "sentence2", "score"])
    for split, count in zip(("train", "dev"), stsb, strict=True):
        a, _ = labelled_sentences(rng, count, words)
        b, _ = labelled_sentences(rng, count, words)
        rows = [f"{i}\tg\tf\t2012\t{i}\ts\ts\t{x}\t{y}\t{rng.uniform(0, 5):.2f}"
                for i, (x, y) in enumerate(zip(a, b, strict=True))]
        (root / "STS-B" / f"{split}.tsv").write_text(header + "\n" + "\n".join(rows) + "\n")
    return str(root)


XLM_DICTIONARY_START = ("<s>", "</s>", "<pad>", "<unk>", *(f"<special{i}>" for i in range(10)))


def write_xlm_tokenizer(folder: Path, lines: list[str], lowercase: bool, merges: int,
                        lang2id: dict[str, int] | None = None) -> Path:
    """An HF XLM tokenizer folder for `lines`: fastBPE-style merges (words split at whitespace,
    `</w>` on each word's last character) learned by `tokenizers`' BPE trainer; a vocab.json in
    XLM's dictionary order (<s> </s> <pad> <unk> <special0..9>), every character with and
    without `</w>`, the merged symbols; merges.txt as `a b count`; the casing in
    tokenizer_config.json and `lang2id` in config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    lines = [line.lower() if lowercase else line for line in lines]
    alphabet = sorted({c for line in lines for c in line if not c.isspace()})
    bpe = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    bpe.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    bpe.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=2 * len(alphabet) + merges, end_of_word_suffix="</w>", show_progress=False))
    learned = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
               for m in json.loads(bpe.to_str())["model"]["merges"]]
    symbols = [*XLM_DICTIONARY_START, *alphabet, *(c + "</w>" for c in alphabet),
               *(a + b for a, b in learned)]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(
        {s: i for i, s in enumerate(dict.fromkeys(symbols))}, ensure_ascii=False))
    (folder / "merges.txt").write_text("".join(f"{a} {b} {len(learned) - n}\n"
                                               for n, (a, b) in enumerate(learned)))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"do_lowercase_and_remove_accent": lowercase}))
    if lang2id:
        (folder / "config.json").write_text(json.dumps({"model_type": "xlm", "lang2id": lang2id}))
    return folder
