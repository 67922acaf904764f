"""Parameter names of earlier versions, renamed where checkpoints are restored.

BERT and ELECTRA's generator once held their masked-LM head's parameters themselves
(`mlm_transform`, `mlm_layer_norm`, `mlm_bias`); they now hold the shared `MaskedLMHead` at
`lm_head` (`lm_head.dense`, `lm_head.layer_norm`, `lm_head.bias`), as RoBERTa, ALBERT and MPNet
always did. Workdirs (training state: parameters and optimizer moments) and pretext model
directories written before keep their old names on disk; `pretrain.trainer` and
`pretrain.loading` rename them on restore with `migrate_path` / `migrate`. HF exports are not
affected (they hold HF names).

The old names are unique to the old layouts, so a rename applies wherever such a key occurs in a
restored tree (at the model's root for BERT, under `generator` for the joint ELECTRA model, and
under every optimizer-moment tree).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

# An old parameter (or module) name -> the path that replaces it, relative to the same module.
RENAMED: dict[str, tuple[str, ...]] = {
    "mlm_transform": ("lm_head", "dense"),
    "mlm_layer_norm": ("lm_head", "layer_norm"),
    "mlm_bias": ("lm_head", "bias"),
}


def migrate_path(path: tuple[Hashable, ...]) -> tuple[Hashable, ...]:
    """A restored leaf's path (dict keys and list indices) with old names replaced."""
    return tuple(part for key in path
                 for part in (RENAMED.get(key, (key,)) if isinstance(key, str) else (key,)))


def has_old_names(tree: Any) -> bool:
    """Whether a restored tree of nested dicts and lists uses any old name."""
    if isinstance(tree, Mapping):
        return any(key in RENAMED or has_old_names(value) for key, value in tree.items())
    if isinstance(tree, list | tuple):
        return any(has_old_names(value) for value in tree)
    return False


def migrate(tree: Any) -> Any:
    """A restored tree of nested dicts (e.g. a pure parameter dict) with old names replaced;
    anything else is returned as it is."""
    if not isinstance(tree, Mapping):
        return tree
    migrated: dict[Any, Any] = {}
    for key, value in tree.items():
        *parents, name = RENAMED.get(key, (key,))
        node = migrated
        for parent in parents:
            node = node.setdefault(parent, {})
        node[name] = migrate(value)
    return migrated
