"""A frozen BERT teacher in the student's model (DistilBERT, TinyBERT): reading it from
`model.teacher`, refusing what is not a BERT, building the pair under jit and copying the
teacher's weights into its `Frozen` Variables (`models.layers.Frozen`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.models.bert import Bert
from pretext_jax.models.layers import Frozen


def load_teacher(where: str, load: Callable[[str], Any], method: str, accepts: str) -> Any:
    """The model at `model.teacher` = `where` (`load`: the trainer's reader); an empty or
    missing path is refused in one line naming what `method` accepts."""
    if not where:
        raise UserError(f"model.teacher is empty; {method} needs the BERT to distil: pass "
                        f"model.teacher=PATH ({accepts})")
    if not Path(where).is_dir():
        raise UserError(f"model.teacher={where} is not a directory; pass {accepts}")
    return load(where)


def check_is_bert(teacher: Any, where: str, method: str) -> None:
    """`teacher` must be a BERT (`models.bert.Bert` without ERNIE 2.0's task types)."""
    if not isinstance(teacher, Bert) or teacher.config.task_type_vocab_size:
        raise UserError(f"{where} holds a {type(teacher).__name__}, not a BERT "
                        "(BertForMaskedLM, BertForPreTraining, BertModel, a pretext bert run); "
                        f"{method} distils a BERT")


def mismatched_fields(theirs: Any, config: Any, fields: Mapping[str, str]) -> list[str]:
    """`model.<ours>=<value>` for each teacher config field (`fields`: theirs -> our setting's
    name) whose value differs from the setting's."""
    return [f"model.{ours}={getattr(theirs, field)}" for field, ours in fields.items()
            if getattr(theirs, field) != getattr(config, ours)]


def built_under_jit(build: Callable[[], nnx.Module]) -> nnx.Module:
    """`build()` initialised under jit (eagerly, every small op would compile on its own)."""
    graphdef = nnx.graphdef(nnx.eval_shape(build))
    return nnx.merge(graphdef, jax.jit(lambda: nnx.state(build()))())


def freeze_into(frozen: nnx.Module, source: nnx.Module) -> None:
    """Sets every `Frozen` Variable of `frozen` to the `nnx.Param` at the same path of
    `source` (the loaded teacher, or its encoder)."""
    weights = dict(nnx.to_flat_state(nnx.state(source, nnx.Param)))
    for path, variable in nnx.to_flat_state(nnx.state(frozen, Frozen)):
        variable.set_value(weights[path][...])
