"""pretext-jax: self-supervised pre-training methods (BERT, ELECTRA, XLNet, SimCLR, ...) on one
sharded JAX/Flax trainer. The checkout's top-level folders are this package's subpackages:
`pretext_jax.pretrain`, `.models`, `.objectives`, `.input_pipeline`; `pretext_jax.run` is the
command line (`pretext-jax`, or `python run.py` in a checkout)."""

__version__ = "0.2.0"
