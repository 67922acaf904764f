"""The one exception type for bad user input (files, configs, checkpoints).

`run.py` prints its message as a single line and exits non-zero, without a traceback. Every
message names the fix. It lives at the package root, below every layer (`models`,
`input_pipeline`, `objectives`, `pretrain`), so that each can raise it without importing
another layer.
"""


class UserError(Exception):
    """Bad input from the user; the message is one line that says what to change."""
