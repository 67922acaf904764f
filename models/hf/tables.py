"""Importing this registers the built-in HuggingFace conversion tables with
`models.hf.conversion`: every other module of this folder is one model family's table, which
calls `conversion.register`, so a new family is its own file and nothing here changes."""

import importlib
import pkgutil

from pretext_jax.models import hf

for _module in sorted(info.name for info in pkgutil.iter_modules(hf.__path__)
                      if info.name not in ("conversion", "tables")):
    importlib.import_module(f"{hf.__name__}.{_module}")
