"""Causal-LM examples: one token stream of all documents, cut into contiguous blocks.

As GPT-2's training data (Radford et al. 2019 §2.1-2.2: documents joined by <|endoftext|>)
and transformers' run_clm.py `group_texts` (concatenate, chop into blocks), except that
consecutive blocks share one token so that no target is lost at block boundaries: the stream
s_0 .. s_{n-1} (documents' tokens, the tokenizer's end-of-text id between documents) gives
blocks b_i = s[i*T : i*T + T + 1] for T = `max_seq_length`, i = 0 .. ceil((n-1)/T) - 1. A block
feeds s[i*T : i*T + T] to the model and predicts s[i*T + 1 : i*T + T + 1]: T targets, so every
token but s_0 is a target exactly once per pass over the data. The last block is padded; its
`token_mask` marks the real tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from pretext_jax.input_pipeline.prepare import Documents
from pretext_jax.input_pipeline.tokenizers import Tokenizer


@dataclasses.dataclass(frozen=True)
class GPTExampleConfig:
    """`max_seq_length`: tokens the model sees per example (targets per full block)."""

    max_seq_length: int = 128
    """Tokens the model sees per example, T; at most model.max_position_embeddings (GPT-2 1024)."""

    def __post_init__(self) -> None:
        if self.max_seq_length < 1:
            raise ValueError(f"max_seq_length {self.max_seq_length} must be at least 1")


def token_stream(documents: Documents, eos_id: int) -> np.ndarray:
    """All documents' tokens (their sentences in order) with `eos_id` between documents."""
    parts = []
    for index, document in enumerate(documents):
        if index:
            parts.append([eos_id])
        parts.extend(document)
    return np.fromiter((t for part in parts for t in part), np.int32)


def blocks(stream: np.ndarray, max_seq_length: int, pad_id: int
           ) -> Iterator[dict[str, np.ndarray]]:
    """The overlapping blocks of `max_seq_length` + 1 tokens (see the module docstring):
    `tokens` [T + 1] and `token_mask` [T + 1] (1 = real token, 0 = padding of the last)."""
    length = max_seq_length
    for start in range(0, max(len(stream) - 1, 0), length):
        piece = stream[start:start + length + 1]
        tokens = np.full(length + 1, pad_id, np.int32)
        tokens[:len(piece)] = piece
        mask = np.zeros(length + 1, np.int32)
        mask[:len(piece)] = 1
        yield {"tokens": tokens, "token_mask": mask}


def create_training_examples(documents: Documents, tokenizer: Tokenizer,
                             config: GPTExampleConfig
                             ) -> Iterator[dict[str, np.ndarray]]:
    """Causal-LM records of tokenised documents (prepare_text's example builder)."""
    return blocks(token_stream(documents, tokenizer.eos_id), config.max_seq_length,
                  tokenizer.pad_id)
