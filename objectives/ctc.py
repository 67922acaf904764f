"""Speech recognition by CTC fine-tuning of wav2vec 2.0 (Baevski et al. 2020 §4; Graves et al.
2006), method and task `ctc` (`run.py finetune --task ctc`): a linear output layer over a
character vocabulary on the pre-trained network (`models.wav2vec2.Wav2Vec2ForCTC`), the CTC loss,
greedy decoding, and WER / CER of the dev set beside the empty transcript's. Data: transcribed
audio (`input_pipeline.transcripts`); recipe: fairseq's `base_10h` (`FINETUNE_RECIPE`).

Reference: fairseq `criterions/ctc.py` (`CtcCriterion`: per-utterance CTC losses summed, the
gradient normalised by the number of target characters, greedy decoding for the WER it logs)
and HF transformers `Wav2Vec2ForCTC.forward` (`ctc_loss_reduction`, labels < 0 = padding,
`pad_token_id` = blank). Word and character error rates are `jiwer`'s (the `ctc` extra).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from pretext_jax.errors import UserError, require
from pretext_jax.input_pipeline import transcripts
from pretext_jax.input_pipeline.audio import audio_window, read_audio, resample, to_pcm16
from pretext_jax.input_pipeline.prepare import DataConfig, fingerprint, source_fingerprint
from pretext_jax.input_pipeline.records import RecordDirectory, write_records
from pretext_jax.models.wav2vec2 import (
    Wav2Vec2Body,
    Wav2Vec2Config,
    Wav2Vec2CTCConfig,
    Wav2Vec2ForCTC,
    feature_lengths,
    with_body_of,
)
from pretext_jax.objectives.common.speech import MaskingSettings, span_mask
from pretext_jax.objectives.registry import (
    Batch,
    DownstreamTask,
    Evaluation,
    FinetuneRecipe,
    Method,
    Metrics,
    PreparedData,
    Resolution,
    Start,
    register,
    register_task,
)

CTC_REDUCTIONS = ("mean", "sentences", "tokens", "sum")
"""How per-utterance CTC losses make the batch loss: `mean` is HF's `ctc_loss_reduction="mean"`
(torch's: each loss divided by its transcript's length, then averaged over the batch),
`sentences` fairseq's with `sentence_avg=True` (its fine-tuning configs: the sum over the batch
divided by the utterances), `tokens` fairseq's with `sentence_avg=False` (the sum divided by the
batch's total transcript length), `sum` HF's default (the plain sum)."""


def ctc_loss(logits: jax.Array, frames: jax.Array, labels: jax.Array, *, blank_id: int = 0,
             reduction: str = "mean") -> tuple[jax.Array, jax.Array]:
    """The CTC loss (`optax.ctc_loss`, the forward algorithm in log space): `logits` [B, T, V],
    `frames` [B, T] (True = real frame), `labels` [B, N] right-padded with negative values (HF's
    -100). -> (the batch loss reduced as `reduction`, see `CTC_REDUCTIONS`; per-utterance
    negative log-likelihoods [B]). An utterance whose frames cannot hold its transcript (more
    characters, counting a blank between repeats, than frames) gets a loss of order 1e5
    (optax's log(0) stand-in) where torch gives inf; fine-tuning data should not have such."""
    if reduction not in CTC_REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} must be one of {CTC_REDUCTIONS}")
    label_paddings = (labels < 0).astype(jnp.float32)
    per_utterance = optax.ctc_loss(
        logits.astype(jnp.float32), 1.0 - frames.astype(jnp.float32),
        jnp.where(labels < 0, 0, labels), label_paddings, blank_id=blank_id)  # [B]
    lengths = jnp.sum(1.0 - label_paddings, axis=-1)  # [B]
    if reduction == "mean":
        loss = jnp.mean(per_utterance / jnp.maximum(lengths, 1.0))
    elif reduction == "sentences":
        loss = jnp.mean(per_utterance)
    elif reduction == "tokens":
        loss = jnp.sum(per_utterance) / jnp.maximum(jnp.sum(lengths), 1.0)
    else:
        loss = jnp.sum(per_utterance)
    return loss, per_utterance


def greedy_keep(logits: jax.Array, frames: jax.Array, blank_id: int = 0
                ) -> tuple[jax.Array, jax.Array]:
    """Best-path decoding on device: the most likely class of each frame [B, T] and where it
    starts a new symbol [B, T] (a real frame, not the blank, not a repeat of the frame
    before: repeats collapse, then blanks drop, so a blank separates a doubled letter)."""
    best = jnp.argmax(logits, axis=-1)  # [B, T]
    previous = jnp.pad(best[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    return best, frames.astype(bool) & (best != blank_id) & (best != previous)


def greedy_decode(logits: jax.Array | np.ndarray, frames: jax.Array | np.ndarray,
                  blank_id: int = 0) -> list[list[int]]:
    """`greedy_keep` read back on the host: each utterance's decoded class ids."""
    best, keep = (np.asarray(a) for a in greedy_keep(jnp.asarray(logits), jnp.asarray(frames),
                                                       blank_id))
    return [row[kept].tolist() for row, kept in zip(best, keep, strict=True)]


def error_rates(references: Sequence[str], hypotheses: Sequence[str]) -> dict[str, float]:
    """Word and character error rates over a set (jiwer: edit operations summed over every
    utterance, divided by the references' total words or characters, spaces counted as
    characters), as the paper's WER tables (§5). The empty transcript's are 1.0 each."""
    jiwer = require("jiwer", "ctc", "word error rates")
    references, hypotheses = list(references), list(hypotheses)
    return {"wer": float(jiwer.wer(references, hypotheses)),
            "cer": float(jiwer.cer(references, hypotheses))}


# --- The registered method: `run.py finetune --task ctc` ------------------------------------

CTC = "ctc"
CTC_METRICS = ("wer", "cer")
DECODE_BATCH = 16  # utterances per decoding batch of the dev set (one compiled shape)


@dataclasses.dataclass(frozen=True)
class CTCModelConfig(Wav2Vec2CTCConfig):
    """The fine-tuned network (`Wav2Vec2CTCConfig`) and where it starts: `init`, a pretext
    wav2vec 2.0 workdir or model directory or a HF Wav2Vec2 folder ("" = random)."""

    init: str = ""
    """The pre-trained (or fine-tuned) wav2vec 2.0 whose body the run starts from."""
    vocab_size: int = 0
    """Output classes; 0 = the vocabulary's size, set from the data."""

    def __post_init__(self) -> None:
        if self.vocab_size:
            super().__post_init__()
        else:  # the data sets it before the model is built
            Wav2Vec2Config.__post_init__(self)


@dataclasses.dataclass(frozen=True)
class CTCExampleConfig:
    """Transcribed utterances (`input_pipeline.transcripts`): `data.source` the training
    manifest (TSV or LibriSpeech folder), `data.eval_source` the dev one (or `TRAIN,DEV` in
    `data.source`)."""

    task: str = CTC
    """The downstream task (`ctc`)."""
    sample_rate: int = 16000
    """The model's rate in Hz; every utterance is resampled to it."""
    max_samples: int = 250_000
    """Longest utterance (samples) kept; longer ones are dropped at preparation and counted
    (fairseq skips them too), shorter ones padded to it (one compiled shape)."""
    normalize: bool = False
    """Zero mean, unit variance per utterance (fairseq `normalize`, false for BASE)."""
    vocabulary: str = ""
    """A HF vocab.json to use; "" = built from the training transcripts and written to the
    records' folder."""
    max_label_length: int = 256
    """Most characters of a transcript (word delimiters included); longer is an error."""
    max_eval_examples: int = 1000
    """Most dev utterances decoded at each evaluation (the first ones)."""

    def __post_init__(self) -> None:
        for name in ("sample_rate", "max_samples", "max_label_length", "max_eval_examples"):
            if getattr(self, name) < 1:
                raise UserError(f"examples.{name}={getattr(self, name)} must be >= 1")


@dataclasses.dataclass(frozen=True)
class CTCObjectiveConfig:
    """Fine-tuning settings (fairseq examples/wav2vec/config/finetuning/base_10h.yaml): time
    masks of `mask_span` frames from a `mask_start_fraction` of the frames (mask_prob 0.65 /
    10), channel masks of `channel_mask_span` channels from a `channel_mask_fraction` of them
    (mask_channel_prob 0.5 / 64), the context network frozen for `freeze_updates`, the loss
    reduced as `reduction` (`CTC_REDUCTIONS`; fairseq's `sentence_avg` is `sentences`)."""

    mask_start_fraction: float = 0.065
    """Fraction of frames that start a masked span (fairseq `mask_prob` / `mask_length`); 0 =
    no time masks."""
    mask_span: int = 10
    """Frames per time mask (fairseq `mask_length`)."""
    channel_mask_fraction: float = 0.0078125
    """Fraction of the channels that start a masked channel span (`mask_channel_prob` /
    `mask_channel_length`); 0 = none."""
    channel_mask_span: int = 64
    """Channels per channel mask (fairseq `mask_channel_length`)."""
    freeze_updates: int = 10000
    """Updates during which only the output layer trains (fairseq `freeze_finetune_updates`)."""
    reduction: str = "sentences"
    """mean, sentences, tokens or sum (see `objectives.ctc.CTC_REDUCTIONS`)."""

    def __post_init__(self) -> None:
        for name in ("mask_start_fraction", "channel_mask_fraction"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1)")
        if min(self.mask_span, self.channel_mask_span) < 1 or self.freeze_updates < 0:
            raise ValueError("mask_span and channel_mask_span must be >= 1, freeze_updates >= 0")
        if self.reduction not in CTC_REDUCTIONS:
            raise ValueError(f"reduction={self.reduction!r} must be one of {CTC_REDUCTIONS}")


def _spans(lengths: np.ndarray, width: int, fraction: float, span: int, min_spans: int,
           rng: np.random.Generator) -> np.ndarray:
    if fraction == 0.0:
        return np.zeros((len(lengths), width), bool)
    return span_mask(lengths, width, MaskingSettings(fraction, span, min_spans), rng)


class FinetuneMasking(grain.transforms.RandomMap):
    """An utterance -> the same plus `mask_time_indices` [T] over its real frames (fairseq's
    `compute_mask_indices`, at least 2 spans) and `mask_channel_indices` [H] (no minimum), drawn
    with Grain's per-record rng as `wav2vec2`'s pre-training masks are."""

    def __init__(self, config: Wav2Vec2CTCConfig, objective: CTCObjectiveConfig):
        self.config, self.objective = config, objective

    def random_map(self, element: dict[str, np.ndarray], rng: np.random.Generator
                   ) -> dict[str, np.ndarray]:
        o, c = self.objective, self.config
        frames = int(feature_lengths(c, len(element["attention_mask"])))
        real = np.maximum(feature_lengths(c, element["attention_mask"].sum(keepdims=True)), 0)
        return {**element,
                "mask_time_indices": _spans(real, frames, o.mask_start_fraction, o.mask_span, 2,
                                            rng)[0],
                "mask_channel_indices": _spans(np.array([c.hidden_size]), c.hidden_size,
                                               o.channel_mask_fraction, o.channel_mask_span, 0,
                                               rng)[0]}


def finetune_loss(model: Wav2Vec2ForCTC, batch: Batch, rng: jax.Array | None, *,
                  objective: CTCObjectiveConfig) -> tuple[jax.Array, Metrics]:
    """The CTC loss of a transcribed batch (`audio`, `attention_mask`, `labels` padded with -1;
    while training, `FinetuneMasking`'s masks); the context network's gradient is stopped while
    `model.updates` < `freeze_updates`, which training advances by one."""
    updates = model.updates.get_value()
    training = rng is not None
    logits, frames = model(batch["audio"], batch["attention_mask"],
                           batch.get("mask_time_indices") if training else None,
                           batch.get("mask_channel_indices") if training else None, rng,
                           frozen_context=updates < objective.freeze_updates)
    loss, per_utterance = ctc_loss(logits, frames, batch["labels"],
                                   blank_id=model.config.blank_id, reduction=objective.reduction)
    if training:
        model.updates.set_value(updates + 1)
    rows = jnp.ones((), jnp.float32) * per_utterance.shape[0]
    return loss, {"loss": (loss * rows, rows),
                  "frozen": (jnp.asarray(updates < objective.freeze_updates, jnp.float32),
                             jnp.ones((), jnp.float32))}


def _split_sources(data: DataConfig) -> tuple[str, str]:
    train, _, dev = data.source.partition(",")
    dev = dev or data.eval_source
    if not dev:
        raise UserError("CTC fine-tuning needs dev transcripts: --data TRAIN,DEV or "
                        "data.eval_source=DEV (a TSV manifest or a LibriSpeech folder)")
    return train, dev


def _encoded(utterances: list[transcripts.Utterance], vocabulary: transcripts.CharVocabulary,
             examples: CTCExampleConfig) -> Iterator[dict[str, np.ndarray]]:
    """Each utterance at the model's rate as int16 samples with its labels [max_label_length]
    (-1 padded); utterances over `max_samples` are skipped."""
    for utterance, labels in zip(utterances, transcripts.encode_all(vocabulary, utterances),
                                 strict=True):
        if len(labels) > examples.max_label_length:
            raise UserError(f"{utterance.where}: the transcript has {len(labels)} characters, "
                            f"more than examples.max_label_length={examples.max_label_length}; "
                            "raise it")
        samples, rate = read_audio(utterance.audio)
        pcm = to_pcm16(resample(samples, rate, examples.sample_rate))
        if len(pcm) > examples.max_samples:
            continue
        padded = np.full(examples.max_label_length, -1, np.int32)
        padded[:len(labels)] = labels
        yield {"labels": padded, "audio": pcm}


class TranscribedAudio(RecordDirectory):
    """Prepared utterances -> `audio` float32 [max_samples] (zero-padded), `attention_mask`
    int32 [max_samples], `labels` int32 [max_label_length]."""

    def __init__(self, directory: Path, examples: CTCExampleConfig):
        super().__init__(directory)
        self.example_config = examples

    def example(self, element: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        audio, mask = audio_window(element["audio"], self.example_config.max_samples, 0,
                                   self.example_config.normalize)
        return {"audio": audio, "attention_mask": mask, "labels": element["labels"]}

    def load_transforms(self) -> list[Any]:
        return [*super().load_transforms(), _Map(self.example)]

    def examples(self, indices: Sequence[int]) -> dict[str, np.ndarray]:
        rows = [self.example(self.spec.decode(self.source[int(i)])) for i in indices]
        return {key: np.stack([row[key] for row in rows]) for key in rows[0]}


class _Map(grain.transforms.Map):
    """A function as a Grain map."""

    def __init__(self, function: Any):
        self.function = function

    def map(self, element: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.function(element)


def prepare_ctc(data: DataConfig, examples: CTCExampleConfig, cache_dir: Path,
                seed: int) -> PreparedData:
    """Both manifests read and every transcript encoded before anything is written (a missing
    audio file or an unknown character is a one-line error naming its line); the vocabulary
    (`examples.vocabulary` or the training transcripts'); records of both splits under a
    fingerprint of the manifests and settings; the dev set in memory for the loss and WER."""
    train_spec, dev_spec = _split_sources(data)
    train, dev = transcripts.read_transcripts(train_spec), transcripts.read_transcripts(dev_spec)
    vocabulary = (transcripts.CharVocabulary.load(Path(examples.vocabulary))
                  if examples.vocabulary
                  else transcripts.CharVocabulary.from_transcripts(u.text for u in train))
    for split in (train, dev):
        transcripts.encode_all(vocabulary, split)
    key = fingerprint("ctc", dataclasses.asdict(examples), vocabulary.tokens,
                      [source_fingerprint(s) for s in (train_spec, dev_spec)])
    base = Path(cache_dir) / key
    records = {}
    for name, split in (("train", train), ("dev", dev)):
        if not (base / name / "features.json").is_file() and not write_records(
                _encoded(split, vocabulary, examples), base / name, variable="audio",
                metadata={"source": name}):
            raise UserError(f"every {name} utterance is longer than examples.max_samples="
                                f"{examples.max_samples}; raise it")
        records[name] = TranscribedAudio(base / name, examples)
    vocabulary.save(base / transcripts.VOCAB_FILE)
    dev_records = records["dev"]
    dev_eval = dev_records.examples(range(min(len(dev_records), examples.max_eval_examples)))
    references = [vocabulary.decode([i for i in row if i >= 0]) for row in dev_eval["labels"]]
    return PreparedData(
        train=records["train"], eval=dev_eval,
        model_fields={"vocab_size": len(vocabulary.tokens), "blank_id": vocabulary.blank_id},
        report={"empty_baseline": error_rates(references, [""] * len(references)),
                "references": references, "vocabulary": vocabulary})


@nnx.jit
def _forward(model: Wav2Vec2ForCTC, audio: jax.Array, attention_mask: jax.Array
             ) -> tuple[jax.Array, jax.Array]:
    return model(audio, attention_mask)


def transcribe(model: Wav2Vec2ForCTC, audio: np.ndarray, attention_mask: np.ndarray,
               vocabulary: transcripts.CharVocabulary) -> list[str]:
    """Greedy transcripts of utterances, `DECODE_BATCH` at a time (the last batch padded)."""
    texts = []
    for start in range(0, len(audio), DECODE_BATCH):
        rows = slice(start, start + DECODE_BATCH)
        count = len(audio[rows])
        pad = ((0, DECODE_BATCH - count), (0, 0))
        logits, frames = _forward(model, jnp.asarray(np.pad(audio[rows], pad)),
                                  jnp.asarray(np.pad(attention_mask[rows], pad)))
        texts += [vocabulary.decode(ids) for ids in greedy_decode(
            logits, frames, model.config.blank_id)[:count]]
    return texts


def wer_monitor(model: Wav2Vec2ForCTC, data: PreparedData, examples: CTCExampleConfig,
                objective: Any = None) -> dict[str, float]:
    """WER and CER of greedy decoding over the dev utterances held in memory."""
    hypotheses = transcribe(model, data.eval["audio"], data.eval["attention_mask"],
                            data.report["vocabulary"])
    return error_rates(data.report["references"], hypotheses)


def build_ctc(config: CTCModelConfig, seed: int) -> Wav2Vec2ForCTC:
    with nnx.use_eager_sharding(False):
        return Wav2Vec2ForCTC(config, rngs=nnx.Rngs(seed))


def pretrained_ctc(config: CTCModelConfig, seed: int,
                   load: Callable[[str], nnx.Module]) -> Wav2Vec2ForCTC | None:
    """A fresh output layer on the body of `config.init` (None: random init)."""
    if not config.init:
        return None
    pretrained = load(config.init)
    if not isinstance(pretrained, Wav2Vec2Body):
        raise UserError(f"model.init={config.init} holds a {type(pretrained).__name__}; CTC "
                        "fine-tuning starts from wav2vec 2.0 (a pretext wav2vec2 run or a HF "
                        "Wav2Vec2 folder)")
    try:
        return with_body_of(pretrained, build_ctc(config, seed))
    except ValueError as e:
        raise UserError(f"model.init={config.init}: {e}; leave the model sizes to run.py "
                        "finetune, which copies them from the starting point") from None


FINETUNE_RECIPE = {  # fairseq examples/wav2vec/config/finetuning/base_10h.yaml
    "optim.optimizer": "adamw", "optim.learning_rate": 5e-5, "optim.schedule": "tri_stage",
    "optim.warmup_init_learning_rate": 5e-7, "optim.end_learning_rate": 2.5e-6,
    "optim.hold_steps": 8000, "optim.b2": 0.98, "optim.eps": 1e-8, "optim.weight_decay": 0.0,
    "optim.bias_correction": True, "optim.clip_norm": 0.0,
    "model.hidden_dropout": 0.0, "model.attention_dropout": 0.0,
    "model.activation_dropout": 0.1, "model.feature_projection_dropout": 0.0,
    "model.final_dropout": 0.0, "model.layerdrop": 0.05, "train.batch_size": 8,
}
NETWORK_FIELDS = tuple(f.name for f in dataclasses.fields(Wav2Vec2Config)
                       if f.name not in ("hidden_dropout", "attention_dropout",
                                         "activation_dropout", "feature_projection_dropout",
                                         "quantizer_input_dropout", "layerdrop"))


def ctc_recipe(pretrained: Any, task: DownstreamTask, source_config: Mapping[str, Any]
               ) -> FinetuneRecipe | None:
    """wav2vec 2.0 (pre-trained or fine-tuned) on task `ctc`: the starting network's sizes
    and `FINETUNE_RECIPE` for 20,000 updates (2,000 warmup, 8,000 hold, 10,000 decay; the
    context network frozen for the first 10,000)."""
    if (task.name != CTC or not isinstance(pretrained, Wav2Vec2Body)
            or not isinstance(pretrained.config, Wav2Vec2Config)):  # not HuBERT's
        return None
    network = {f"model.{name}": getattr(pretrained.config, name) for name in NETWORK_FIELDS}
    return FinetuneRecipe(values={"method": CTC, **{k: list(v) if isinstance(v, tuple) else v
                                                     for k, v in network.items()},
                                  **FINETUNE_RECIPE},
                          epochs=0, warmup=0.0, steps=20000, warmup_steps=2000)


def ctc_train_rows(data: str, config: Any) -> int:
    """Training utterances the manifest lists (those over `examples.max_samples`, dropped at
    preparation, are counted too)."""
    return len(transcripts.read_transcripts(data.partition(",")[0]))


def ctc_transforms(data: PreparedData, model: CTCModelConfig, objective: CTCObjectiveConfig
                   ) -> PreparedData:
    return dataclasses.replace(data, transforms=(FinetuneMasking(model, objective),))


register_task(DownstreamTask(  # `run.py finetune --task ctc`
    name=CTC, method=CTC, num_labels=0, train_rows=ctc_train_rows, metrics=CTC_METRICS,
    main_metric="wer", baseline="empty_baseline", baseline_name="empty transcript",
    aliases=("asr",), lower_is_better=True))

METHOD = register(Method(
    name=CTC,
    model_config=CTCModelConfig,
    example_config=CTCExampleConfig,
    objective_config=CTCObjectiveConfig,
    build_model=build_ctc,
    loss=finetune_loss,
    prepare=prepare_ctc,
    units_per_example=lambda examples: examples.max_samples,
    unit="samples",
    description="Fine-tuning: speech recognition with CTC on wav2vec 2.0 (WER, CER)",
    resolution=Resolution(complete_data=ctc_transforms),
    evaluation=Evaluation(monitor=wer_monitor),
    start=Start(hf_models=(Wav2Vec2ForCTC,), pretrained=pretrained_ctc, finetunes=ctc_recipe),
))
