"""Pre-training objectives. Importing the package registers the built-in methods: every module
of this folder is one method family that ends in its `register(Method(...))` call, so a new
method is its own file and nothing here changes; what methods share lives in `common/` and the
registry in `registry.py`."""

import importlib
import pkgutil

for _module in sorted(info.name for info in pkgutil.iter_modules(__path__)
                      if not info.ispkg and info.name != "registry"):
    importlib.import_module(f"{__name__}.{_module}")
