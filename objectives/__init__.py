"""Pre-training objectives. Importing the package registers the built-in methods."""

from objectives import bert, classification, electra, simclr, xlnet  # noqa: F401
