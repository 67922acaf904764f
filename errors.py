"""The one exception type for bad user input (files, configs, checkpoints).

`run.py` prints its message as a single line and exits non-zero, without a traceback. Every
message names the fix. It lives at the package root, below every layer (`models`,
`input_pipeline`, `objectives`, `pretrain`), so that each can raise it without importing
another layer. Also the one place that says which package extra installs a missing optional
dependency (`optional_import`, `require`).
"""

import importlib
from types import ModuleType


class UserError(Exception):
    """Bad input from the user; the message is one line that says what to change."""


def optional_import(module: str, extra: str, purpose: str) -> ModuleType | None:
    """`module` if it is installed, else None: for what only some users need, installed by the
    package extra `extra` (pyproject.toml). `purpose` completes the note printed once when it is
    missing, e.g. "TensorBoard events are not written"."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or not module.startswith(e.name):
            raise  # the package is there but broken: not a missing extra
        if module not in _NOTED:
            _NOTED.add(module)
            print(f"note: {purpose}; pip install 'pretext-jax[{extra}]' for them", flush=True)
        return None


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """`module`, or a UserError naming the package extra that installs it (`purpose`: what
    needs it, e.g. "reading TFDS datasets")."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or not module.startswith(e.name):
            raise
        raise UserError(f"{purpose} needs {module.split('.')[0]}: "
                        f"pip install 'pretext-jax[{extra}]'") from None


_NOTED: set[str] = set()
