"""Pre-training objectives. Importing the package registers the built-in methods."""

from objectives import bert, electra, xlnet  # noqa: F401
