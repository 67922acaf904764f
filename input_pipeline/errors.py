"""The one exception type for bad user input (files, configs, checkpoints).

`run.py` prints its message as a single line and exits non-zero, without a traceback. Every
message names the fix. It lives in the lowest layer so that data, objectives and trainer code
can all raise it without importing upward.
"""


class UserError(Exception):
    """Bad input from the user; the message is one line that says what to change."""
