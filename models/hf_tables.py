"""Importing this registers the built-in HuggingFace conversion tables with `models.conversion`
(one module per model family, one import per line; a new family adds its `<family>_hf.py` and a
line here)."""

from pretext_jax.models import (
    albert_hf,  # noqa: F401
    bert_hf,  # noqa: F401
    electra_hf,  # noqa: F401
    ernie_hf,  # noqa: F401
    gpt_hf,  # noqa: F401
    mpnet_hf,  # noqa: F401
    prophetnet_hf,  # noqa: F401
    resnet_hf,  # noqa: F401
    roberta_hf,  # noqa: F401
    t5_hf,  # noqa: F401
    wav2vec2_hf,  # noqa: F401
    xlm_hf,  # noqa: F401
    xlnet_hf,  # noqa: F401
)
