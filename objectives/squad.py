"""Fine-tuning on SQuAD v1.1 and v2.0 span extraction, as a method of the one trainer
(google-research/bert run_squad.py): the start and end logits of a pre-trained encoder's
states (`models.span.SpanExtractor`), trained with the mean of the start and end positions'
cross-entropies; or, with `model.span_head=beam` on XLNet or ALBERT, XLNet's beam head
(`models.span.BeamSpanExtractor`, zihangdai/xlnet run_squad.py; google-research/albert
squad_utils.py `create_v2_model`, ALBERT's SQuAD v2.0 head) with its answer-class loss; or,
with `model.span_head=answerable` (RoBERTa's v2.0 recipe, Liu et al. 2019 §5.2), the simple
head and an answerability classifier trained jointly (`answerable_loss`); or, with
`model.span_head=joint` (ELECTRA's, google-research/electra qa_tasks.py), a joint start/end
head with an answerability classifier (`joint_loss`); evaluated on the whole dev set by
mapping every question's best span back to its context (`input_pipeline.squad.predict_answers`,
`predict_beam_answers`) and scoring it as the official scripts do
(`objectives.common.squad_metrics`).

`--data` is a folder with the official files: train-v1.1.json and dev-v1.1.json (`squad`) or
train-v2.0.json and dev-v2.0.json (`squad2`). The trivial baseline printed beside the dev
metrics is the empty answer everywhere: 0 on v1.1, the share of unanswerable questions on v2.0.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import prepare, squad
from pretext_jax.input_pipeline.prepare import (
    DataConfig,
    fingerprint,
    source_fingerprint,
    tokenizer_identity,
)
from pretext_jax.input_pipeline.records import RecordDirectory, write_records
from pretext_jax.models.span import (
    ANSWER_CLASS_STARTS,
    BEAM_HEADS,
    JOINT_HEADS,
    SPAN_HEADS,
    AnswerableSpanExtractor,
    BeamFields,
    BeamSpanExtractor,
    JointSpanExtractor,
    SpanExtractor,
    span_extractor,
    span_model_class,
)
from pretext_jax.objectives.common.classifier_recipes import (
    FinetuneModelConfig,
    check_input_length,
    layout_of,
    load_encoder,
)
from pretext_jax.objectives.common.squad_metrics import no_answer_baseline, squad_metrics
from pretext_jax.objectives.registry import (
    Batch,
    DownstreamTask,
    Evaluation,
    Method,
    Metrics,
    PreparedData,
    Resolution,
    Start,
    register,
    register_task,
)

SPAN = "span"  # the method's name


@dataclasses.dataclass(frozen=True)
class SquadVersion:
    """A SQuAD release: its files in the `--data` folder and whether questions may have no
    answer (v2.0)."""

    name: str
    train_file: str
    dev_file: str
    with_null: bool

    def path(self, folder: str, split: str) -> Path:
        name = self.train_file if split == "train" else self.dev_file
        path = Path(folder) / name
        if not path.is_file():
            raise UserError(f"{path} not found: --data must be a folder with the official "
                            f"{self.train_file} and {self.dev_file} ({self.name})")
        return path


VERSIONS = {"squad": SquadVersion("squad", "train-v1.1.json", "dev-v1.1.json", False),
            "squad2": SquadVersion("squad2", "train-v2.0.json", "dev-v2.0.json", True)}


@dataclasses.dataclass(frozen=True)
class SpanModelConfig(FinetuneModelConfig, BeamFields):
    """The encoder's config and its family's `head` (which HF `*ForQuestionAnswering(Simple)`
    it exports to), as the classifiers' (`FinetuneModelConfig`), `init`, where the encoder
    comes from, and the span head (`BeamFields`: simple, or the beam head of XLNet, exported as
    HF `XLNetForQuestionAnswering`, or of ALBERT, which has no HF class)."""


@dataclasses.dataclass(frozen=True)
class SquadExampleConfig:
    """run_squad.py's flags: windows of `max_seq_length` sub-tokens `doc_stride` apart,
    questions cut to `max_query_length`; answers of at most `max_answer_length` sub-tokens
    from the `n_best_size` best starts and ends; v2.0 answers empty when the null score beats
    the best span by more than `null_score_diff_threshold`."""

    task: str = "squad"
    """squad (v1.1) or squad2 (v2.0)."""
    max_seq_length: int = 384
    """Sub-tokens per window incl. [CLS] and two [SEP]s (run_squad.py: 384)."""
    doc_stride: int = 128
    """Sub-tokens between the starts of consecutive windows of a long context."""
    max_query_length: int = 64
    """Questions are cut to this many sub-tokens."""
    max_answer_length: int = 30
    """Longest predicted answer, in sub-tokens."""
    n_best_size: int = 20
    """Starts and ends considered per window."""
    null_score_diff_threshold: float = 0.0
    """v2.0: answer empty when null score - best span score exceeds this (see best_f1_thresh)."""
    max_train_examples: int = 0
    """Train on the first n questions only; 0 = all."""
    layout: str = "bert"
    """Input layout: bert ([CLS] question [SEP] context [SEP]), roberta (<s> question </s></s>
    context </s>), xlnet (context <sep> question <sep> <cls>) or xlm (</s> question </s>
    context </s>); the head's own."""


def _cross_entropy(logits: jax.Array, positions: jax.Array) -> jax.Array:
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(log_probs, positions[:, None].astype(jnp.int32),
                                         axis=1))


def _span_and_class_loss(starts: jax.Array, ends: jax.Array, class_logits: jax.Array,
                         labels: jax.Array, batch: Batch, weight: float
                         ) -> tuple[jax.Array, Metrics]:
    """The mean of the start and end positions' cross-entropies + `weight` x the mean sigmoid
    cross-entropy of `class_logits` [B] against `labels` [B] (0/1), with both in the metrics
    (`answer_class_loss` the latter)."""
    one = jnp.ones((), jnp.float32)
    span = (_cross_entropy(starts, batch["start_positions"])
            + _cross_entropy(ends, batch["end_positions"])) / 2
    labels = labels.astype(jnp.float32)
    answer_class = jnp.mean(jnp.logaddexp(0.0, class_logits) - labels * class_logits)
    loss = span + weight * answer_class
    return loss, {"loss": (loss, one), "answer_class_loss": (answer_class, one)}


def beam_loss(model: BeamSpanExtractor, batch: Batch, rng: jax.Array | None
              ) -> tuple[jax.Array, Metrics]:
    """zihangdai/xlnet run_squad.py `model_fn` (HF `XLNetForQuestionAnswering` and
    google-research/albert squad_utils.py `v2_model_fn_builder` the same): the mean of the
    start and end cross-entropies (the end logits given the gold start), plus 0.5 x the mean
    sigmoid cross-entropy of the answer class against `is_impossible` (the window holds no
    answer: its positions point at `cls_index`)."""
    starts, ends, cls_logits = model(
        batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
        p_mask=batch["p_mask"], start_positions=batch["start_positions"],
        cls_index=batch["cls_index"], rng=rng)
    impossible = batch["start_positions"] == batch["cls_index"]
    return _span_and_class_loss(starts, ends, cls_logits, impossible, batch, 0.5)


def answerable_loss(model: AnswerableSpanExtractor, batch: Batch, rng: jax.Array | None
                    ) -> tuple[jax.Array, Metrics]:
    """RoBERTa §5.2: "the classification and span loss terms" summed: run_squad.py's span loss
    (the mean of the start and end cross-entropies; a window without the answer points both
    at its null token, as for BERT: the paper does not say otherwise) + the mean sigmoid
    cross-entropy of the answerability logit against the question being answerable (the
    paper classifies "whether a given question is answerable"; a window of an answerable
    question that lacks the answer is labelled answerable, as ELECTRA's qa_tasks.py labels
    its windows with the question's `is_impossible`)."""
    starts, ends, answerable_logits = model(
        batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
        cls_index=batch["cls_index"], rng=rng)
    answerable = batch["is_impossible"] == 0
    return _span_and_class_loss(starts, ends, answerable_logits, answerable, batch, 1.0)


def joint_loss(model: JointSpanExtractor, batch: Batch, rng: jax.Array | None
               ) -> tuple[jax.Array, Metrics]:
    """google-research/electra qa_tasks.py `get_prediction_module`: the mean of the start and
    end cross-entropies (the end logits given the gold start) + `answerable_weight` (0.5) x the
    sigmoid cross-entropy of the answerability logit against the question having no answer
    (`is_impossible`, the question's, for every one of its windows), averaged over windows."""
    starts, ends, answerable_logits = model(
        batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
        start_positions=batch["start_positions"], rng=rng)
    return _span_and_class_loss(starts, ends, answerable_logits, batch["is_impossible"], batch,
                                0.5)


SpanModel = SpanExtractor | BeamSpanExtractor | JointSpanExtractor


def span_loss(model: SpanModel, batch: Batch, rng: jax.Array | None
              ) -> tuple[jax.Array, Metrics]:
    """run_squad.py `model_fn`: the mean of the start and end positions' cross-entropies over
    every window position (the beam head: `beam_loss`; the answerable head:
    `answerable_loss`; the joint head: `joint_loss`)."""
    if isinstance(model, BeamSpanExtractor):
        return beam_loss(model, batch, rng)
    if isinstance(model, JointSpanExtractor):
        return joint_loss(model, batch, rng)
    if isinstance(model, AnswerableSpanExtractor):
        return answerable_loss(model, batch, rng)
    starts, ends = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
                         rng=rng)
    one = jnp.ones((), jnp.float32)
    loss = (_cross_entropy(starts, batch["start_positions"])
            + _cross_entropy(ends, batch["end_positions"])) / 2
    return loss, {"loss": (loss, one)}


@nnx.jit
def _logits(model: SpanExtractor, input_ids: jax.Array, token_type_ids: jax.Array,
            attention_mask: jax.Array, cls_index: jax.Array) -> tuple[jax.Array, ...]:
    if isinstance(model, AnswerableSpanExtractor):
        return model(input_ids, token_type_ids, attention_mask, cls_index=cls_index)
    return model(input_ids, token_type_ids, attention_mask)


def span_logits(model: SpanExtractor, arrays: dict[str, np.ndarray], batch_size: int = 64
                ) -> tuple[np.ndarray, ...]:
    """Evaluation-mode start and end logits [N, L] of every window (and, from the answerable
    head, its answerability logits [N])."""
    parts: list[list[np.ndarray]] = []
    for begin in range(0, len(arrays["input_ids"]), batch_size):
        outputs = _logits(model, *(arrays[k][begin:begin + batch_size] for k in (
            "input_ids", "token_type_ids", "attention_mask", "cls_index")))
        parts.append([np.asarray(output, np.float32) for output in outputs])
    return tuple(np.concatenate(column) for column in zip(*parts, strict=True))


@nnx.jit
def _beams(model: BeamSpanExtractor | JointSpanExtractor, input_ids: jax.Array,
           token_type_ids: jax.Array, attention_mask: jax.Array, p_mask: jax.Array,
           cls_index: jax.Array) -> dict[str, jax.Array]:
    if isinstance(model, JointSpanExtractor):
        return model.beam(input_ids, token_type_ids, attention_mask)
    return model.beam(input_ids, token_type_ids, attention_mask, p_mask=p_mask,
                      cls_index=cls_index)


def beam_outputs(model: BeamSpanExtractor | JointSpanExtractor, arrays: dict[str, np.ndarray],
                 batch_size: int = 64) -> dict[str, np.ndarray]:
    """The beam or joint head's evaluation outputs of every window (their `beam`)."""
    parts: dict[str, list[np.ndarray]] = {}
    for begin in range(0, len(arrays["input_ids"]), batch_size):
        out = _beams(model, *(arrays[k][begin:begin + batch_size] for k in (
            "input_ids", "token_type_ids", "attention_mask", "p_mask", "cls_index")))
        for key, value in out.items():
            parts.setdefault(key, []).append(np.asarray(value))
    return {key: np.concatenate(value) for key, value in parts.items()}


@dataclasses.dataclass(frozen=True)
class DevSet:
    """What the monitor reads: the dev questions, their windows and the tokenizer."""

    examples: Sequence[squad.SquadExample]
    windows: squad.Windows
    tokenizer: Any


def squad_monitor(model: SpanModel, data: PreparedData,
                  examples: SquadExampleConfig, objective: Any = None) -> dict[str, float]:
    """The official metrics of the predicted answers on the whole dev set (v2.0: with the
    HasAns/NoAns split and the best null-score thresholds); the beam head's answers from its
    beams (`squad.predict_beam_answers`, by the rules of the head's family)."""
    dev: DevSet = data.monitor_data
    version = VERSIONS[examples.task]
    options = dict(with_null=version.with_null, n_best=examples.n_best_size,
                   max_answer_length=examples.max_answer_length,
                   null_score_diff_threshold=examples.null_score_diff_threshold)
    if isinstance(model, BeamSpanExtractor | JointSpanExtractor):
        rules = "electra" if isinstance(model, JointSpanExtractor) else model.config.head
        predicted = squad.predict_beam_answers(
            dev.examples, dev.windows, beam_outputs(model, dev.windows.arrays), dev.tokenizer,
            rules=rules, **options)
    else:
        starts, ends, *answerable = span_logits(model, dev.windows.arrays)
        predicted = squad.predict_answers(
            dev.examples, dev.windows, starts, ends, dev.tokenizer,
            answerable_logits=answerable[0] if answerable else None, **options)
    answers = {e.qid: e.answers for e in dev.examples}
    if not version.with_null:
        return squad_metrics(predicted.text, answers)
    return squad_metrics(predicted.text, answers, best_non_null=predicted.best_non_null,
                         score_diff=predicted.score_diff)


def _windows(path: Path, data: DataConfig, examples: SquadExampleConfig, split: str
             ) -> tuple[list[squad.SquadExample], squad.Windows]:
    questions = squad.read_squad(path)
    if split == "train" and examples.max_train_examples:
        questions = questions[:examples.max_train_examples]
    return questions, squad.encode_windows(
        questions, prepare.load_tokenizer(data), examples.max_seq_length, examples.doc_stride,
        examples.max_query_length, examples.layout)


@functools.lru_cache(maxsize=2)
def _cached_windows(path: str, stamp: Any, data: DataConfig, examples: SquadExampleConfig,
                    split: str) -> tuple[list[squad.SquadExample], squad.Windows]:
    del stamp  # part of the key: an edited file is read again
    return _windows(Path(path), data, examples, split)


def windows_of(data: DataConfig, examples: SquadExampleConfig, split: str
               ) -> tuple[list[squad.SquadExample], squad.Windows]:
    """The split's questions and windows (encoded once per process and file version: the
    step count and the run read the same ones)."""
    if not data.tokenizer:
        raise UserError("fine-tuning needs the starting point's tokenizer: set data.tokenizer "
                        "(run.py finetune sets it from --init)")
    path = VERSIONS[examples.task].path(data.source, split)
    stat = path.stat()
    return _cached_windows(str(path), (stat.st_size, stat.st_mtime_ns), data, examples, split)


def prepare_squad(data: DataConfig, examples: SquadExampleConfig, cache_dir: Path,
                  seed: int) -> PreparedData:
    """The training windows as records (cached under a fingerprint of the file, tokenizer and
    settings); the dev windows in memory, with their questions for the monitor."""
    version = VERSIONS[examples.task]
    tokenizer = prepare.load_tokenizer(data) if data.tokenizer else None
    # "windows-3": records with p_mask, cls_index and is_impossible (older caches lack them)
    key = fingerprint("squad", "windows-3", version.name, dataclasses.asdict(examples),
                      source_fingerprint(str(version.path(data.source, "train"))),
                      *tokenizer_identity(data))
    train_dir = Path(cache_dir) / key / "train"
    if not (train_dir / "features.json").is_file():
        _, train = windows_of(data, examples, "train")
        count = len(train)
        if count == 0:
            raise UserError(f"{version.path(data.source, 'train')} holds no questions")
        write_records(({k: v[i] for k, v in train.arrays.items()} for i in range(count)),
                      train_dir, metadata={"task": version.name, "windows": count})
    questions, dev = windows_of(data, examples, "dev")
    baseline = no_answer_baseline({e.qid: e.answers for e in questions})
    return PreparedData(train=RecordDirectory(train_dir), eval=dev.arrays,
                        model_fields={"num_labels": 2},
                        report={"no_answer_baseline": baseline}, tokenizer=tokenizer,
                        monitor_data=DevSet(questions, dev, tokenizer))


def check_squad(model: SpanModelConfig, examples: SquadExampleConfig,
                objective: Any = None) -> None:
    """A known SQuAD version, the head's layout, windows that fit the positions."""
    if examples.task not in VERSIONS:
        raise UserError(f"examples.task={examples.task} is no SQuAD version; use squad or "
                        "squad2")
    wanted = layout_of(model.head)
    if examples.layout != wanted:
        raise UserError(f"examples.layout={examples.layout} does not suit model.head="
                        f"{model.head}; use examples.layout={wanted}")
    check_input_length(model, examples.max_seq_length)
    if model.span_head not in SPAN_HEADS:
        raise UserError(f"model.span_head={model.span_head} is unknown; use one of {SPAN_HEADS}")
    if model.span_head == "beam" and model.head not in BEAM_HEADS:
        raise UserError(f"model.span_head=beam is the head of {BEAM_HEADS}; model.head="
                        f"{model.head} takes model.span_head=simple")
    if model.span_head == "joint" and model.head not in JOINT_HEADS:
        raise UserError(f"model.span_head=joint reads BERT's token types (heads {JOINT_HEADS});"
                        f" model.head={model.head} takes model.span_head=simple")
    if model.span_head == "answerable" and not VERSIONS[examples.task].with_null:
        raise UserError("model.span_head=answerable classifies unanswerable questions, which "
                        f"{examples.task} has none of; use it with squad2 or take "
                        "model.span_head=simple")
    if model.answer_class_start not in ANSWER_CLASS_STARTS:
        raise UserError(f"model.answer_class_start={model.answer_class_start} is unknown; use "
                        f"one of {ANSWER_CLASS_STARTS}")
    if model.start_n_top < 1 or model.end_n_top < 1:
        raise UserError("model.start_n_top and model.end_n_top must be >= 1")
    if examples.doc_stride < 1 or examples.n_best_size < 1 or examples.max_answer_length < 1:
        raise UserError("examples.doc_stride, n_best_size and max_answer_length must be >= 1")


def pretrained_span_extractor(config: SpanModelConfig, seed: int,
                              load: Callable[[str], nnx.Module]
                              ) -> SpanModel | None:
    """The encoder of `config.init` under a fresh span head of `config.span_head` (None:
    random init)."""
    if not config.init:
        return None
    encoder = load_encoder(config.init, load, config.head, config.init_layers)
    return span_extractor(encoder, config, nnx.Rngs(seed))


def build_span_extractor(config: SpanModelConfig, seed: int
                         ) -> SpanModel:
    model_class = span_model_class(config)
    with nnx.use_eager_sharding(False):
        return model_class(config, rngs=nnx.Rngs(seed))


def squad_train_rows(data: str, config: Any) -> int:
    """Training windows of the run `config` on the folder `data` (run_squad.py counts its
    steps in windows)."""
    del data  # config.data.source
    return len(windows_of(config.data, config.examples, "train")[1])


_V2_METRICS = ("HasAns_exact", "HasAns_f1", "NoAns_exact", "NoAns_f1", "best_exact",
               "best_exact_thresh", "best_f1", "best_f1_thresh")
for _version, _aliases in ((VERSIONS["squad"], ("squad1", "squadv1", "squad1.1")),
                           (VERSIONS["squad2"], ("squadv2", "squad2.0"))):
    register_task(DownstreamTask(
        name=_version.name, method=SPAN, num_labels=2,
        train_rows=squad_train_rows,
        metrics=("exact", "f1", *(_V2_METRICS if _version.with_null else ())),
        main_metric="f1", baseline="no_answer_baseline", baseline_name="no answer",
        max_seq_length=384, aliases=_aliases, spec=_version))


METHOD = register(Method(
    name=SPAN,
    model_config=SpanModelConfig,
    example_config=SquadExampleConfig,
    build_model=build_span_extractor,
    loss=span_loss,
    prepare=prepare_squad,
    units_per_example=lambda examples: examples.max_seq_length,
    description="Fine-tuning: span extraction (SQuAD v1.1/v2.0)",
    resolution=Resolution(check=check_squad),
    evaluation=Evaluation(monitor=squad_monitor),
    start=Start(hf_models=(SpanExtractor, BeamSpanExtractor),
                pretrained=pretrained_span_extractor),
))
