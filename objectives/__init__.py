"""Pre-training objectives. Importing the package registers the built-in methods (one module per
method family, one import per line)."""

from pretext_jax.objectives import (
    albert,  # noqa: F401
    amdim,  # noqa: F401
    bert,  # noqa: F401
    byol,  # noqa: F401
    classification,  # noqa: F401
    cmc,  # noqa: F401
    cpc,  # noqa: F401
    deepcluster,  # noqa: F401
    dim,  # noqa: F401
    electra,  # noqa: F401
    elmo,  # noqa: F401
    ernie,  # noqa: F401
    gpt,  # noqa: F401
    jigsaw,  # noqa: F401
    mass,  # noqa: F401
    moco,  # noqa: F401
    mpnet,  # noqa: F401
    prophetnet,  # noqa: F401
    roberta,  # noqa: F401
    rotation,  # noqa: F401
    seq2seq,  # noqa: F401
    simclr,  # noqa: F401
    structbert,  # noqa: F401
    translation,  # noqa: F401
    unilm,  # noqa: F401
    wav2vec2,  # noqa: F401
    word2vec,  # noqa: F401
    xlm,  # noqa: F401
    xlnet,  # noqa: F401
)
