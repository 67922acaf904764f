"""Starting a run from a pre-trained model (`registry.Start.pretrained`): the settings that are
the run's own, and the check that the rest of the architecture is the pre-trained model's."""

from __future__ import annotations

import dataclasses
from typing import Any

from pretext_jax.errors import UserError

# Fields that may differ between the pre-trained model and the run that starts from it.
RUN_FIELDS = frozenset({"init", "hidden_dropout", "attention_dropout", "dropout", "layerdrop",
                        "dtype", "scan_layers", "remat", "attention_implementation"})


def check_same_architecture(config: Any, pretrained: Any, init: str,
                            free: frozenset[str] = frozenset()) -> None:
    """Every field of `pretrained` (the loaded model's config) but `RUN_FIELDS` and `free`
    equals `config`'s; a difference is a UserError naming the setting and its matching value."""
    for field in dataclasses.fields(pretrained):
        ours, theirs = getattr(config, field.name), getattr(pretrained, field.name)
        if field.name not in RUN_FIELDS | free and ours != theirs:
            raise UserError(f"model.{field.name}={ours} differs from the pre-trained model's "
                            f"{theirs} ({init}); set model.{field.name}={theirs}")
