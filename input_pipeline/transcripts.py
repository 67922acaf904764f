"""Transcribed speech for CTC fine-tuning: the character vocabulary and the manifests that pair
audio files with their transcripts.

Vocabulary: one class per character, "|" for the space between words, and the specials of
fairseq's dictionary, `<pad>` (the CTC blank), `<s>`, `</s>`, `<unk>`, first (fairseq
`examples/wav2vec/libri_labels.py` writes letters with "|" word boundaries; HF
`Wav2Vec2CTCTokenizer` keeps the same classes in `vocab.json`, `{"<pad>": 0, "<s>": 1, ...}`,
which `CharVocabulary.load` and `save` read and write).

Manifests (`read_transcripts`): a TSV file of `audio path<TAB>transcript` lines (paths
relative to the file's folder unless absolute), or a LibriSpeech folder, whose
`<speaker>/<chapter>/<speaker>-<chapter>.trans.txt` files hold `<utterance id> <TRANSCRIPT>`
lines beside `<utterance id>.flac`. Every line is checked before anything is written: a missing
audio file is an error naming its manifest line.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from pretext_jax.errors import UserError

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)
WORD_DELIMITER = "|"
VOCAB_FILE = "vocab.json"


@dataclasses.dataclass(frozen=True)
class Utterance:
    """One transcribed audio file and where it was listed (`file:line`, for messages)."""

    audio: Path
    text: str
    where: str


@dataclasses.dataclass(frozen=True)
class CharVocabulary:
    """Classes by id: `tokens[i]` is class i; `<pad>` is the blank, "|" the word delimiter."""

    tokens: tuple[str, ...]

    def __post_init__(self) -> None:
        for required in (PAD, WORD_DELIMITER):
            if required not in self.tokens:
                raise UserError(f"the character vocabulary has no {required!r}; add it to "
                                f"{VOCAB_FILE} (the CTC blank is {PAD!r}, words end at "
                                f"{WORD_DELIMITER!r})")
        if len(set(self.tokens)) != len(self.tokens):
            raise UserError(f"the character vocabulary lists a token twice; fix {VOCAB_FILE}")

    @property
    def blank_id(self) -> int:
        return self.tokens.index(PAD)

    @property
    def ids(self) -> dict[str, int]:
        return {token: i for i, token in enumerate(self.tokens)}

    @classmethod
    def from_transcripts(cls, texts: Iterable[str]) -> CharVocabulary:
        """The specials, "|", then every character of `texts` (spaces excepted) by falling
        frequency, ties in character order (fairseq's dictionary order)."""
        counts = collections.Counter(c for text in texts for c in text if not c.isspace())
        counts.pop(WORD_DELIMITER, None)
        chars = sorted(counts, key=lambda c: (-counts[c], c))
        return cls((*SPECIALS, WORD_DELIMITER, *chars))

    @classmethod
    def load(cls, path: Path) -> CharVocabulary:
        """A HF `vocab.json` (token -> id, ids 0..n-1)."""
        try:
            ids = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"cannot read the vocabulary {path} ({e}); pass a HF vocab.json"
                            ) from None
        if not isinstance(ids, dict) or sorted(ids.values()) != list(range(len(ids))):
            raise UserError(f"{path} must map each token to a distinct id 0..{len(ids) - 1}; "
                            "fix the file")
        return cls(tuple(sorted(ids, key=ids.get)))

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.ids, ensure_ascii=False, indent=1) + "\n")

    def encode(self, text: str, where: str = "a transcript") -> list[int]:
        """Characters -> ids, words joined by "|" (runs of spaces are one boundary, none at
        the ends); a character outside the vocabulary is an error naming `where`."""
        ids = self.ids
        out = []
        for word_index, word in enumerate(text.split()):
            if word_index:
                out.append(ids[WORD_DELIMITER])
            for char in word:
                if char not in ids or char in SPECIALS:
                    raise UserError(f"{where}: character {char!r} is not in the vocabulary; "
                                    f"add it to {VOCAB_FILE} or normalise the transcript")
                out.append(ids[char])
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """Ids (already collapsed, e.g. `objectives.common.ctc.greedy_decode`) -> text: specials
        dropped, "|" a space, no space at the ends or twice."""
        chars = [self.tokens[i] for i in ids if self.tokens[i] not in SPECIALS]
        return " ".join("".join(chars).replace(WORD_DELIMITER, " ").split())


def _audio(path: str, base: Path, where: str) -> Path:
    audio = Path(path) if Path(path).is_absolute() else base / path
    if not audio.is_file():
        raise UserError(f"{where}: audio file {audio} does not exist; fix or remove the line")
    return audio


def read_tsv(manifest: Path) -> list[Utterance]:
    """`audio path<TAB>transcript` lines; blank lines skipped."""
    utterances = []
    for number, line in enumerate(Path(manifest).read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{manifest}:{number}"
        path, tab, text = line.partition("\t")
        if not tab or not path.strip():
            raise UserError(f"{where}: expected 'audio path<TAB>transcript'; fix the line")
        utterances.append(Utterance(_audio(path.strip(), manifest.parent, where), text.strip(),
                                    where))
    return utterances


def read_librispeech(root: Path) -> list[Utterance]:
    """Every `*.trans.txt` under `root`: `<id> <TRANSCRIPT>` lines, audio `<id>.flac` beside
    the file."""
    utterances = []
    for transcripts in sorted(Path(root).rglob("*.trans.txt")):
        for number, line in enumerate(transcripts.read_text().splitlines(), 1):
            if not line.strip():
                continue
            where = f"{transcripts}:{number}"
            name, _, text = line.strip().partition(" ")
            utterances.append(Utterance(_audio(f"{name}.flac", transcripts.parent, where),
                                        text.strip(), where))
    return utterances


def read_transcripts(spec: str | Path) -> list[Utterance]:
    """A TSV manifest file, or a LibriSpeech folder (`*.trans.txt` files)."""
    path = Path(spec)
    if path.is_file():
        utterances = read_tsv(path)
    elif path.is_dir():
        utterances = read_librispeech(path)
    else:
        raise UserError(f"transcripts {spec} do not exist; pass a TSV manifest (audio path "
                        "TAB text) or a LibriSpeech folder")
    if not utterances:
        raise UserError(f"{spec} lists no transcribed audio; pass a TSV manifest with "
                        "'audio path<TAB>transcript' lines or a folder with *.trans.txt files")
    return utterances


def encode_all(vocabulary: CharVocabulary, utterances: Sequence[Utterance]) -> list[list[int]]:
    """Every transcript encoded, each error naming its manifest line."""
    return [vocabulary.encode(u.text, u.where) for u in utterances]
