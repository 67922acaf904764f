"""TinyBERT's data augmentation for task distillation (Jiao et al. 2020 §3.3, Algorithm 1):
every GLUE training sentence followed by up to N variants in which words are replaced by their
candidates, written as a GLUE folder that `run.py finetune` reads like the original.

Reference: huawei-noah/Pretrained-Language-Model TinyBERT/data_augmentation.py (`DataAugmentor`,
`AugmentProcessor`, its argparse defaults and per-task N), re-stated:
- Words: BERT's basic tokens of the sentence (lower-cased with an uncased vocabulary). A word is
  replaced only if it is all letters a-z (either case) and not one of the script's stop words
  (NLTK's English list less its wh-words, plus 's and 're).
- Candidates of a word that is one WordPiece: the M = 15 most likely tokens of a BERT masked LM
  at that piece, masked, in the input `[CLS] sentence-with-[MASK] [SEP] sentence [SEP]` (token
  types 0 up to the first [SEP], 1 after; cut at 512 positions, none when the piece is beyond),
  less those starting with `##`. Of a word of several pieces: its M nearest words by cosine
  among the first 100,000 of a GloVe file, itself left out (title-cased when the word is).
  None found (or no GloVe file given): the word itself.
- Variants: N times, each candidate word is drawn uniformly from its candidates and put in with
  probability p = 0.4 (the draw first, then the coin); a sentence not yet in the list joins it.
  The list starts with the original sentence as written; variants are the basic tokens joined
  by spaces.
- Rows: each training row is written once per variant of its first text column, then once per
  variant of the second (pair tasks), the first column then holding its last variant, as the
  script's loop leaves it. The header row is kept; dev and test files are copied.
- N per task: the script's (SST-2 20; CoLA, MRPC, RTE and STS-B 30); M 15, p 0.4.
Departures: the script draws from Python's unseeded `random`; here each row has its own
generator seeded by `(seed, row)`, so output is deterministic and a killed run resumes by
whole chunks of rows (`CHUNK_ROWS`). The masked LM runs batched (padded to a few lengths) on
the default device instead of one sentence at a time; its top M come from `jax.lax.top_k`
(ties: the lower id first).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import re
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import glue
from pretext_jax.input_pipeline.tokenizers import WordPieceTokenizer, load_tokenizer
from pretext_jax.models.bert import Bert
from pretext_jax.pretrain import hf
from pretext_jax.pretrain.finetune import tokenizer_of
from pretext_jax.pretrain.loading import MODEL_FILE, load_model
from pretext_jax.progress import progress

# data_augmentation.py's `StopWordsList`: NLTK's English stop words less its eight wh-words
# (what, which, who, whom, when, where, why, how), and 's and 're.
_STOP_WORDS = """
i me my myself we our ours ourselves you you're you've you'll you'd your yours yourself
yourselves he him his himself she she's her hers herself it it's its itself they them their
theirs themselves this that that'll these those am is are was were be been being have has had
having do does did doing a an the and but if or because as until while of at by for with
about against between into through during before after above below to from up down in out on
off over under again further then once here there all any both each few more most other some
such no nor not only own same so than too very s t can will just don don't should should've now
d ll m o re ve y ain aren aren't couldn couldn't didn didn't doesn doesn't hadn hadn't hasn
hasn't haven haven't isn isn't ma mightn mightn't mustn mustn't needn needn't shan shan't
shouldn shouldn't wasn wasn't weren weren't won won't wouldn wouldn't 's 're
"""
STOP_WORDS = frozenset(_STOP_WORDS.split())
TASK_COPIES = {"cola": 30, "sst2": 20, "mrpc": 30, "stsb": 30, "rte": 30}
"""N, the variants per sentence (data_augmentation.py `default_params`; its "STS-b" key never
matches the task name STS-B, which so takes the argparse default, 30)."""
CANDIDATES = 15  # M
REPLACE_PROB = 0.4  # p
GLOVE_WORDS = 100_000  # `prepare_embedding_retrieval`'s vocab_size
MAX_POSITIONS = 512  # `_masked_language_model`'s cut
CHUNK_ROWS = 256
"""Rows augmented together (their masked-LM queries batched) and written as one part file."""
MLM_BATCH = 32
PARTS = ".parts"
PLAN_FILE = "plan.json"
_LETTERS = re.compile(r"[a-z]+")


@dataclasses.dataclass(frozen=True)
class AugmentSettings:
    """Algorithm 1's N (`copies`, 0: the task's), M (`candidates`) and p (`replace_prob`), and
    the seed of the variants' draws."""

    copies: int = 0
    candidates: int = CANDIDATES
    replace_prob: float = REPLACE_PROB
    seed: int = 0


def replaceable(word: str) -> bool:
    """data_augmentation.py `_is_valid` and not a stop word."""
    return bool(_LETTERS.fullmatch(word.lower())) and word.lower() not in STOP_WORDS


class WordVectors:
    """The first `limit` words of a GloVe text file (`word v1 v2 ...` a line), unit length
    (`prepare_embedding_retrieval`; an all-zero vector never comes out as a neighbour)."""

    def __init__(self, path: str | Path, limit: int = GLOVE_WORDS):
        words, rows = [], []
        try:
            with open(path, encoding="utf-8") as lines:
                for number, line in enumerate(lines, 1):
                    if number > limit:
                        break
                    word, *values = line.rstrip("\n").split(" ")
                    try:
                        rows.append([float(v) for v in values if v])
                    except ValueError:
                        raise UserError(f"{path} line {number}: not `word value value ...`; "
                                        "pass a GloVe text file (e.g. glove.6B.300d.txt)"
                                        ) from None
                    words.append(word)
        except (FileNotFoundError, IsADirectoryError, UnicodeDecodeError) as e:
            raise UserError(f"--glove {path}: {type(e).__name__}; pass a GloVe text file "
                            "(e.g. glove.6B.300d.txt)") from None
        if not rows or len({len(r) for r in rows}) != 1:
            raise UserError(f"{path}: no vectors, or vectors of different lengths; pass a GloVe "
                            "text file")
        vectors = np.asarray(rows, np.float64)
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        self.unit = np.divide(vectors, norms, out=np.zeros_like(vectors), where=norms > 0)
        self.usable = norms[:, 0] > 0
        self.words = words
        self.index = {word: i for i, word in enumerate(words)}
        self._found: dict[tuple[str, int], list[str]] = {}  # a word recurs across rows

    def neighbours(self, word: str, count: int) -> list[str]:
        """`DataAugmentor._word_distance`: the `count` words of highest cosine similarity."""
        if word not in self.index:
            return []
        if (word, count) not in self._found:
            self._found[word, count] = self._nearest(word, count)
        return list(self._found[word, count])

    def _nearest(self, word: str, count: int) -> list[str]:
        similarity = np.where(self.usable, self.unit @ self.unit[self.index[word]], -np.inf)
        similarity[self.index[word]] = -np.inf
        found = [self.words[i] for i in np.argsort(-similarity, kind="stable")[:count]
                 if np.isfinite(similarity[i])]
        return [w.title() for w in found] if word.istitle() else found


@functools.partial(nnx.jit, static_argnames="count")
def _top_tokens(model: Bert, ids: jax.Array, types: jax.Array, mask: jax.Array,
                position: jax.Array, count: int) -> jax.Array:
    """The ids of the `count` most likely tokens at each row's masked `position`."""
    logits = model(ids, types, mask, masked_positions=position[:, None]).mlm_logits
    return jax.lax.top_k(logits[:, 0], count)[1]


class MaskedLMCandidates:
    """A BERT masked LM's top-`count` tokens at one masked piece of a sentence, for many
    queries at once (`DataAugmentor._masked_language_model`, batched)."""

    def __init__(self, model: Bert, tokenizer: WordPieceTokenizer, count: int):
        self.model, self.tokenizer, self.count = model, tokenizer, count
        self.limit = min(MAX_POSITIONS, model.config.max_position_embeddings)

    def query(self, pieces: Sequence[int], at: int) -> tuple[list[int], list[int], int] | None:
        """(ids, token types, masked position) of the input for piece `at` of `pieces`, or
        None where that position is cut off."""
        t = self.tokenizer
        position = 1 + at
        if position >= self.limit:
            return None
        masked = [t.cls_id, *pieces[:at], t.mask_id, *pieces[at + 1:]]
        ids = [*masked, t.sep_id, *pieces, t.sep_id][:self.limit]
        first = min(len(masked), self.limit - 1) + 1  # types 0 through the first [SEP]
        return ids, [0] * first + [1] * (len(ids) - first), position

    def candidates(self, queries: Sequence[tuple[list[int], list[int], int]]) -> list[list[str]]:
        """Each query's candidate words: its top tokens less the `##` continuations."""
        found: list[list[str]] = []
        for start in range(0, len(queries), MLM_BATCH):
            batch = list(queries[start:start + MLM_BATCH])
            rows = len(batch)
            batch += [batch[-1]] * (MLM_BATCH - rows)
            width = max(16, 1 << (max(len(ids) for ids, _, _ in batch) - 1).bit_length())
            width = min(width, self.limit)
            ids = np.zeros((MLM_BATCH, width), np.int32)
            types, mask = np.zeros_like(ids), np.zeros_like(ids)
            for row, (query_ids, query_types, _) in enumerate(batch):
                ids[row, :len(query_ids)] = query_ids
                types[row, :len(query_types)] = query_types
                mask[row, :len(query_ids)] = 1
            positions = np.array([position for _, _, position in batch], np.int32)
            top = np.asarray(_top_tokens(self.model, jnp.asarray(ids), jnp.asarray(types),
                                         jnp.asarray(mask), jnp.asarray(positions),
                                         self.count))
            for row in top[:rows]:
                tokens = [self.tokenizer.id_to_token(int(i)) for i in row]
                found.append([token for token in tokens if not token.startswith("##")])
        return found


class Augmentor:
    """Algorithm 1 over sentences: candidates (`MaskedLMCandidates`, `WordVectors`), then the
    variants."""

    def __init__(self, mlm: MaskedLMCandidates, vectors: WordVectors | None,
                 settings: AugmentSettings):
        self.mlm, self.vectors, self.settings = mlm, vectors, settings

    def candidates(self, sentences: Sequence[str]) -> list[tuple[list[str], dict[int, list[str]]]]:
        """Each sentence's basic tokens and the candidates of its replaceable words (by
        position), the masked-LM queries of all the sentences run together."""
        tokenizer, m = self.mlm.tokenizer, self.settings.candidates
        found, queries, asked = [], [], []
        for sentence in sentences:
            words = tokenizer.basic_tokens(sentence)
            per_word = [tokenizer.word_pieces(word) for word in words]
            pieces = [piece for word_pieces in per_word for piece in word_pieces]
            choices: dict[int, list[str]] = {}
            start = 0
            for index, (word, word_pieces) in enumerate(zip(words, per_word, strict=True)):
                if replaceable(word):
                    choices[index] = []
                    if len(word_pieces) == 1:
                        query = self.mlm.query(pieces, start)
                        if query is not None:
                            queries.append(query)
                            asked.append((len(found), index))
                    elif self.vectors is not None:
                        choices[index] = self.vectors.neighbours(word, m)
                start += len(word_pieces)
            found.append((words, choices))
        for (sentence, index), words in zip(asked, self.mlm.candidates(queries), strict=True):
            found[sentence][1][index] = words
        for words, choices in found:
            for index, options in choices.items():
                if not options:
                    options.append(words[index])
        return found

    def variants(self, sentence: str, words: list[str], choices: dict[int, list[str]],
                 copies: int, draw: random.Random) -> list[str]:
        """`DataAugmentor.augment`'s loop: the sentence, then each new variant."""
        out = [sentence]
        for _ in range(copies):
            new = list(words)
            for index, options in choices.items():
                option = draw.choice(options)
                if draw.random() < self.settings.replace_prob:
                    new[index] = option
            joined = " ".join(new)
            if joined not in out:
                out.append(joined)
        return out


def masked_lm(bert: str) -> tuple[Bert, WordPieceTokenizer]:
    """The masked LM and its WordPiece tokenizer: a HF BERT folder with its MLM head
    (`BertForMaskedLM`, `BertForPreTraining`) or a pretext `bert` run."""
    path = Path(bert)
    if (path / MODEL_FILE).is_file():
        model, missing = load_model(path), []
    else:
        with warnings.catch_warnings():  # the pooler and NSP head, unused here
            warnings.simplefilter("ignore")
            model, missing = hf.read(path)
    if type(model) is not Bert or any(p.startswith("lm_head.") for p in missing):
        raise UserError(f"--bert {bert} is not a BERT with its masked-LM head; pass a HF "
                        "BertForMaskedLM / BertForPreTraining folder (the paper: "
                        "bert-base-uncased) or a pretext bert run")
    tokenizer = load_tokenizer(tokenizer_of(bert))
    if not isinstance(tokenizer, WordPieceTokenizer):
        raise UserError(f"--bert {bert} has no WordPiece vocab.txt; the augmentation's words "
                        "and pieces are BERT's")
    return model, tokenizer


def augment_glue(task: str, data: str | Path, out: str | Path, bert: str,
                 glove: str | Path | None = None,
                 settings: AugmentSettings = AugmentSettings()) -> dict[str, Any]:
    """`task`'s GLUE folder under `data` augmented into `out` (the same layout: the augmented
    train.tsv, the other splits copied). Chunks of rows are written under `out/.parts` as
    they finish, so a rerun after a kill resumes; train.tsv appears last, whole."""
    spec = glue.glue_task(task)
    if spec.name not in TASK_COPIES:
        raise UserError(f"--task {task}: augmentation covers {', '.join(TASK_COPIES)}")
    source = Path(data) / spec.folder
    train = source / "train.tsv"
    if not train.is_file():
        raise UserError(f"{train} not found; pass --data the folder that holds {spec.folder}/")
    glue.read_glue_tsv(data, spec, "train")  # the format's one-line errors before any work
    target = Path(out) / spec.folder
    if (target / "train.tsv").exists():
        raise UserError(f"{target / 'train.tsv'} exists; pass another --out")
    if Path(out).resolve() == Path(data).resolve():
        raise UserError("--out is --data; pass a new folder for the augmented copy")
    copies = settings.copies or TASK_COPIES[spec.name]
    plan = {"task": spec.name, "data": str(Path(data).resolve()), "bert": str(Path(bert).resolve()),
            "glove": str(Path(glove).resolve()) if glove else None, "copies": copies,
            **{k: v for k, v in dataclasses.asdict(settings).items() if k != "copies"}}
    parts = target / PARTS
    if (parts / PLAN_FILE).is_file() and json.loads((parts / PLAN_FILE).read_text()) != plan:
        raise UserError(f"{parts} holds the chunks of an augmentation with other settings; "
                        "rerun with those, or remove it to start again")
    model, tokenizer = masked_lm(bert)
    vectors = WordVectors(glove) if glove else None
    augmentor = Augmentor(MaskedLMCandidates(model, tokenizer, settings.candidates), vectors,
                          settings)
    lines = train.read_text(encoding="utf-8").splitlines()
    header, rows = (lines[:1], lines[1:]) if spec.has_header else ([], lines)
    columns = [c for c in (spec.text_a_column, spec.text_b_column) if c is not None]
    parts.mkdir(parents=True, exist_ok=True)
    (parts / PLAN_FILE).write_text(json.dumps(plan))
    chunks = range(0, len(rows), CHUNK_ROWS)
    for start in progress(chunks, f"augmenting {spec.folder}", unit="chunk"):
        part = parts / f"{start // CHUNK_ROWS:06d}.tsv"
        if part.is_file():
            continue
        cells = [row.split("\t") for row in rows[start:start + CHUNK_ROWS]]
        found = iter(augmentor.candidates([r[c] for r in cells for c in columns]))
        written = []
        for offset, row in enumerate(cells):
            draw = random.Random(f"{settings.seed}:{start + offset}")
            for column in columns:
                words, choices = next(found)
                for sentence in augmentor.variants(row[column], words, choices, copies, draw):
                    row[column] = sentence
                    written.append("\t".join(row))
        staging = part.with_suffix(".tmp")
        staging.write_text("".join(line + "\n" for line in written), encoding="utf-8")
        staging.replace(part)
    staging = target / "train.tsv.tmp"
    count = 0
    with open(staging, "w", encoding="utf-8") as output:
        output.writelines(line + "\n" for line in header)
        for part in sorted(parts.glob("*.tsv")):
            text = part.read_text(encoding="utf-8")
            count += text.count("\n")
            output.write(text)
    for other in source.iterdir():
        if other.is_file() and other.name != "train.tsv":
            shutil.copyfile(other, target / other.name)
    staging.replace(target / "train.tsv")
    shutil.rmtree(parts)
    return {**plan, "rows": len(rows), "augmented_rows": count, "out": str(Path(out))}
