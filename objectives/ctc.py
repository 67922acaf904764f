"""Speech recognition by CTC fine-tuning of wav2vec 2.0 (Baevski et al. 2020 §4; Graves et al.
2006): the CTC loss over a character vocabulary and greedy decoding.

Reference: fairseq `criterions/ctc.py` (`CtcCriterion`: per-utterance CTC losses summed, the
gradient normalised by the number of target characters, greedy decoding for the WER it logs)
and HF transformers `Wav2Vec2ForCTC.forward` (`ctc_loss_reduction`, labels < 0 = padding,
`pad_token_id` = blank). Word and character error rates are `jiwer`'s (the `ctc` extra).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pretext_jax.errors import require

CTC_REDUCTIONS = ("mean", "tokens", "sum")
"""How per-utterance CTC losses make the batch loss: `mean` is HF's `ctc_loss_reduction="mean"`
(torch's: each loss divided by its transcript's length, then averaged over the batch), `tokens`
fairseq's (the sum over the batch divided by the batch's total transcript length, its
`sample_size` with `sentence_avg=False`), `sum` HF's default (the plain sum)."""


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
