"""ERNIE 1.0 knowledge masking (Sun et al. 2019, "ERNIE: Enhanced Representation through
Knowledge Integration", §3.2-3.3) on BERT's sentence pairs.

Masking stages (§3.2, `ErnieExampleConfig.masking`): `basic` masks basic language units (for
English, words: BERT's whole-word masking); `phrase` masks whole phrases; `entity` whole named
entities. Whatever the stage, the units are shuffled and taken whole while the masked tokens
stay within BERT's budget (15% of the tokens, at most `max_predictions_per_seq`), or with
`unit_selection=bernoulli` each unit is taken with probability 0.15 as ERNIE's code does, so a
unit is never masked in part; words outside any phrase or entity are units of their own (as ERNIE's
reference masks every unit, of whatever length, alike). Each masked token gets BERT's 80/10/10
treatment. The paper trains the stages one after the other; here a run uses one stage.

Annotations are written inline in the corpus text (one sentence per line as usual):
`[[ENT:J. K. Rowling]] wrote [[PHR:a series of fantasy novels]]`. `[[ENT:...]]` marks a named
entity, `[[PHR:...]]` a phrase; the markup is removed before tokenization (and from the text a
tokenizer is trained on). Spans are character ranges of the plain sentence, widened to whole
words, and a wordpiece belongs to a span when its characters lie inside it (the sentence is
tokenised piece by piece at the span boundaries: for WordPiece this is the tokenization of the
plain sentence, for sentencepiece a boundary without a space before it gets a word start).
Spans of one kind that overlap are joined.

Without phrase markup (`phrases=chunker`, the default), phrases come from a built-in chunker:
runs of 2-4 consecutive words none of which is a stopword (a short English function-word list),
split at punctuation and digits, a longer run cut into pieces of at most 4. The paper uses a
lexical analysis and chunking tool; this approximates its noun- and verb-group chunks only
roughly (e.g. "new york city" and "fantasy novels" are found, "the city" is not, and adjacent
content words of two different phrases join). `phrases=markup` takes phrases from the markup
alone.

In the records a token id carries its units: bit 24 marks "continues a phrase", bit 25
"continues an entity" (cleared before the records are written).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import bert as bert_examples
from pretext_jax.input_pipeline.examples.albert import choose_ngram_spans
from pretext_jax.input_pipeline.examples.bert import Document, MaskingVocab

STAGES = ("basic", "phrase", "entity")
KINDS = {"PHR": "phrase", "ENT": "entity"}
JOINS = {"phrase": 1 << 24, "entity": 1 << 25}
ID_BITS = (1 << 24) - 1
MARKUP = re.compile(r"\[\[(ENT|PHR):(.*?)\]\]", re.DOTALL)
WORD = re.compile(r"\w+(?:['’-]\w+)*|[^\w\s]")
STOPWORDS = frozenset((  # English function words (the chunker's phrase boundaries)
    "a", "an", "the", "and", "or", "but", "nor", "so", "yet", "if", "then", "than", "that",
    "this", "these", "those", "there", "here", "of", "in", "on", "at", "to", "for", "from",
    "by", "with", "without", "about", "above", "below", "into", "onto", "over", "under",
    "after", "before", "between", "through", "during", "since", "until", "upon", "within",
    "against", "among", "as", "is", "are", "was", "were", "be", "been", "being", "am", "do",
    "does", "did", "done", "have", "has", "had", "having", "will", "would", "shall", "should",
    "can", "could", "may", "might", "must", "not", "no", "it", "its", "it's", "he", "him",
    "his", "she", "her", "hers", "they", "them", "their", "theirs", "we", "us", "our", "ours",
    "you", "your", "yours", "i", "me", "my", "mine", "who", "whom", "whose", "which", "what",
    "when", "where", "why", "how", "all", "any", "both", "each", "few", "more", "most", "other",
    "some", "such", "only", "own", "same", "too", "very", "just", "also", "s", "t",
))
MAX_PHRASE_WORDS = 4


@dataclasses.dataclass(frozen=True)
class ErnieExampleConfig(bert_examples.BertExampleConfig):
    """BERT's example settings with ERNIE's masking stage and phrase source; basic units are
    whole words (`whole_word_mask`, true)."""

    whole_word_mask: bool = True
    masking: str = "phrase"
    """Masking stage: basic (words), phrase or entity (Sun et al. 2019 §3.2)."""
    phrases: str = "chunker"
    """Where phrases come from: chunker (built-in stopword chunker, where a sentence has no
    [[PHR:...]] markup) or markup (only [[PHR:...]] spans)."""
    unit_selection: str = "budget"
    """How units are picked: budget (BERT's: shuffled and taken whole while the masked tokens
    fit `masked_lm_prob` x length, at most `max_predictions_per_seq`) or bernoulli (ERNIE 1.0's
    `batching.py` `mask`: each unit with probability `masked_lm_prob`, whatever its length and
    with no budget; only `max_predictions_per_seq` caps the total, see
    `knowledge_mask_tokens`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.masking not in STAGES:
            raise UserError(f"examples.masking={self.masking!r} is not a stage; use one of "
                            f"{', '.join(STAGES)}")
        if self.phrases not in ("chunker", "markup"):
            raise UserError(f"examples.phrases={self.phrases!r} must be chunker or markup")
        if self.unit_selection not in ("budget", "bernoulli"):
            raise UserError(f"examples.unit_selection={self.unit_selection!r} must be budget "
                            "(BERT's 15 % budget) or bernoulli (ERNIE's code)")
        if self.dynamic_masking:
            raise UserError("examples.dynamic_masking is not available for ERNIE, whose unit "
                            "masks are drawn once per pass; set examples.dynamic_masking=false "
                            "and choose examples.dupe_factor")


Span = tuple[int, int, str]  # [start, end) characters of the plain sentence, phrase / entity


def parse_markup(sentence: str) -> tuple[str, list[Span]]:
    """(plain sentence, its [[ENT:...]] / [[PHR:...]] spans)."""
    plain, spans, last = [], [], 0
    length = 0
    for match in MARKUP.finditer(sentence):
        before = sentence[last:match.start()]
        plain.append(before)
        length += len(before)
        plain.append(match.group(2))
        spans.append((length, length + len(match.group(2)), KINDS[match.group(1)]))
        length += len(match.group(2))
        last = match.end()
    plain.append(sentence[last:])
    return "".join(plain), spans


def chunk_phrases(text: str) -> list[Span]:
    """The built-in phrase chunker (module docstring): runs of 2-4 non-stopword words."""
    spans: list[Span] = []
    run: list[re.Match] = []
    for match in [*WORD.finditer(text), None]:
        word = match.group(0) if match else ""
        if match and word.isalpha() and word.lower() not in STOPWORDS:
            run.append(match)
            continue
        for start in range(0, len(run), MAX_PHRASE_WORDS):
            piece = run[start:start + MAX_PHRASE_WORDS]
            if len(piece) >= 2:
                spans.append((piece[0].start(), piece[-1].end(), "phrase"))
        run = []
    return spans


def _whole_words(text: str, start: int, end: int) -> tuple[int, int]:
    while 0 < start < len(text) and text[start - 1].isalnum() and text[start].isalnum():
        start -= 1
    while 0 < end < len(text) and text[end - 1].isalnum() and text[end].isalnum():
        end += 1
    return start, end


def _joined(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start < out[-1][1]:
            out[-1] = (out[-1][0], max(end, out[-1][1]))
        else:
            out.append((start, end))
    return out


def annotated_ids(text: str, spans: Sequence[Span], tokenizer: Any) -> list[int]:
    """Token ids of `text` with the unit bits of `spans` (module docstring): every token of a
    span but its first carries the span kind's continuation bit."""
    by_kind = {kind: _joined([_whole_words(text, s, e) for s, e, k in spans if k == kind])
               for kind in JOINS}
    cuts = sorted({0, len(text), *(b for ranges in by_kind.values() for r in ranges for b in r)})
    ids: list[int] = []
    for start, end in zip(cuts[:-1], cuts[1:], strict=True):
        piece = tokenizer.encode(text[start:end]) if text[start:end].strip() else []
        for index, token in enumerate(piece):
            for kind, ranges in by_kind.items():
                inside = next((r for r in ranges if r[0] <= start and end <= r[1]), None)
                if inside is not None and (start > inside[0] or index > 0):
                    token |= JOINS[kind]
            ids.append(token)
    return ids


@dataclasses.dataclass(frozen=True)
class ErnieMarkup:
    """ERNIE's `prepare.Markup`: [[ENT:...]] / [[PHR:...]] spans, chunker phrases where a
    sentence has no phrase markup and `chunker` is on."""

    chunker: bool = True

    def plain(self, sentence: str) -> str:
        return parse_markup(sentence)[0]

    def tokenize(self, documents: Iterable[list[str]], tokenizer: Any) -> list[list[list[int]]]:
        out = []
        for document in documents:
            sentences = []
            for sentence in document:
                text, spans = parse_markup(sentence)
                if self.chunker and not any(kind == "phrase" for _, _, kind in spans):
                    spans = spans + chunk_phrases(text)
                ids = annotated_ids(text, spans, tokenizer)
                if ids:
                    sentences.append(ids)
            if sentences:
                out.append(sentences)
        return out


def units(tokens: np.ndarray, vocab: MaskingVocab, config: ErnieExampleConfig
          ) -> list[list[int]]:
    """The masking units of an example's (annotated) tokens at `config.masking`: its basic
    units (`masking_candidates`: words, or pieces without `whole_word_mask`), adjacent ones
    joined where the later one starts with the stage's continuation bit."""
    ids = tokens & ID_BITS
    basic = bert_examples.masking_candidates(ids, vocab, config.whole_word_mask)
    if config.masking == "basic":
        return basic
    joins = (tokens & JOINS[config.masking]) != 0
    out: list[list[int]] = []
    for unit in basic:
        if out and joins[unit[0]] and unit[0] == out[-1][-1] + 1:
            out[-1].extend(unit)
        else:
            out.append(list(unit))
    return out


def knowledge_mask_tokens(tokens: np.ndarray, vocab: MaskingVocab, config: ErnieExampleConfig,
                          rng: np.random.Generator
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Whole units, 80/10/10 per token. With `unit_selection=budget` in random order within
    BERT's `prediction_budget` (a unit that does not fit is passed over); with `bernoulli` each
    unit independently with probability `masked_lm_prob` (ERNIE `batching.py` `mask`), and in
    the rare draw whose units pass `max_predictions_per_seq` (the records' fixed size) the
    units are taken in random order while they fit. Returns (masked ids, sorted positions,
    labels) of the plain ids, as `bert_examples.mask_tokens`."""
    ids = tokens & ID_BITS
    candidates = units(tokens, vocab, config)
    if config.unit_selection == "bernoulli":
        picked = rng.random(len(candidates)) < config.masked_lm_prob
        candidates = [unit for unit, take in zip(candidates, picked, strict=True) if take]
        budget = config.max_predictions_per_seq
    else:
        budget = bert_examples.prediction_budget(len(ids), config)
    chosen = [i for span in choose_ngram_spans(candidates, budget, np.ones(1), rng)
              for unit in span for i in unit]
    output = ids.copy()
    bert_examples.corrupt(output, np.asarray(chosen, np.int64), vocab, config, rng)
    return bert_examples.masked_result(ids, output, chosen)


def create_training_examples(
    documents: Sequence[Document], vocab: MaskingVocab, config: ErnieExampleConfig, seed: int,
) -> Iterator[dict[str, np.ndarray]]:
    """BERT's passes, NSP pairs and records, masked by `knowledge_mask_tokens`."""
    return bert_examples.create_training_examples(documents, vocab, config, seed,
                                                  mask=knowledge_mask_tokens)
