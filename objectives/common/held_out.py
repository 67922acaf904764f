"""Held-out records kept in memory for evaluation, with per-record transforms (dynamic
masking, XLNet's and MPNet's permutations, T5's noise) drawn once with a fixed seed, so
held-out numbers compare across runs.
"""

from __future__ import annotations

from typing import Any

import grain
import numpy as np

from pretext_jax.errors import UserError

MAX_EVAL_EXAMPLES = 16384



def held_out_examples(held_out: Any, transform: grain.transforms.RandomMap | None = None,
                      seed: int = 0, limit: int = MAX_EVAL_EXAMPLES) -> dict[str, np.ndarray]:
    """The held-out records kept in memory for evaluation (at most `limit`), with
    `transform` (masking, noising) drawn once with the fixed seed `seed + 2`, so held-out
    numbers compare across runs."""
    examples = held_out.examples(range(min(len(held_out), limit)))
    return examples if transform is None else mask_records(examples, transform, seed + 2)



def stacked_records(records: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Record sets with the same features, one after the other (several languages' held-out
    records); none at all is a UserError."""
    if not records:
        raise UserError("nothing was held out for evaluation; raise data.held_out_fraction, "
                        "give more text (documents separated by blank lines) or set "
                        "data.eval_source")
    return {key: np.concatenate([r[key] for r in records]) for key in records[0]}



def mask_records(
    records: dict[str, np.ndarray], masking: grain.transforms.RandomMap, seed: int
) -> dict[str, np.ndarray]:
    """Applies a per-record random transform (dynamic masking, XLNet's permutations) once, with
    a fixed seed, to a stacked set of records."""
    rng = np.random.default_rng(seed)
    count = len(next(iter(records.values())))
    rows = [masking.random_map({k: v[i] for k, v in records.items()}, rng) for i in range(count)]
    return {k: np.stack([row[k] for row in rows]) for k in rows[0]}
