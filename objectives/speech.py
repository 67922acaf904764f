"""What the speech methods (wav2vec 2.0, CPC) share: their data preparation from the audio
source (`input_pipeline.audio`)."""

from __future__ import annotations

from pathlib import Path

from pretext_jax.input_pipeline.audio import AudioExampleConfig, prepare_audio
from pretext_jax.input_pipeline.prepare import DataConfig
from pretext_jax.objectives.registry import PreparedData


def prepare_speech(data: DataConfig, examples: AudioExampleConfig, cache_dir: Path,
                   seed: int) -> PreparedData:
    """Audio records (`input_pipeline.audio.prepare_audio`): random `max_samples` crops for
    training, the first window of at most `max_eval_examples` held-out utterances for
    evaluation."""
    train, held_out = prepare_audio(data.source, data.eval_source, cache_dir, examples,
                                    held_out_fraction=data.held_out_fraction, seed=seed,
                                    tfds_split=data.tfds_split,
                                    tfds_data_dir=data.tfds_data_dir or None)
    return PreparedData(train=train, eval=held_out.evaluation_examples(examples.max_eval_examples))
