"""Pre-training objectives. Importing the package registers the built-in methods (one module per
method family, one import per line)."""

from objectives import (
    bert,  # noqa: F401
    classification,  # noqa: F401
    electra,  # noqa: F401
    simclr,  # noqa: F401
    xlnet,  # noqa: F401
)
