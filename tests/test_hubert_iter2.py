"""HuBERT's second iteration (Hsu et al. 2021 §IV-B; fairseq simple_kmeans
dump_hubert_feature.py, learn_kmeans.py, dump_km_label.py): the frozen model's layer features
against HF `HubertModel`'s hidden states, the labels against a numpy nearest centroid of those
features, a tiny iteration-1 run feeding an iteration-2 run, the targets' cache keyed by the
teacher, and the refusals."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_hubert import HEAD, HF_HUBERT_TINY
from test_hubert_training import TINY
from test_wav2vec2_training import clips  # noqa: F401  (the fixture)

from pretext_jax.errors import UserError
from pretext_jax.models.hubert import Hubert, HubertConfig
from pretext_jax.models.wav2vec2 import feature_lengths
from pretext_jax.objectives import hubert
from pretext_jax.objectives.common.preset_parts import TINY_SPEECH_ENCODER
from pretext_jax.pretrain import hf
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.loading import load_pretrained
from pretext_jax.pretrain.trainer import Trainer

ITERATION2 = {**TINY, "objective.targets": "hidden", "objective.target_layer": 1,
              "objective.target_batch_size": 4}


def test_layer_features_are_hf_hidden_states_of_each_utterance_alone(deterministic_torch,
                                                                     tmp_path):
    """`layer_features` of a padded batch (group norm over each row's real samples) equal HF
    `HubertModel(utterance alone).hidden_states[1]` within 1e-5 (block 1's output); the same
    batch through the plain forward (group norm over the padding too, as HF's batched call)
    does not (negative control)."""
    transformers = pytest.importorskip("transformers")
    torch = deterministic_torch
    from parity_utils import hf_reference

    hf_reference("HubertModel", 3, **HF_HUBERT_TINY).save_pretrained(tmp_path)
    reference = transformers.HubertModel.from_pretrained(tmp_path).eval()
    with pytest.warns(UserWarning, match="final_proj"):
        model = hf.load(tmp_path, **HEAD)
    rng = np.random.default_rng(0)
    lengths = [1200, 700, 410]
    audio = np.zeros((3, 1200), np.float32)
    mask = np.zeros((3, 1200), np.int32)
    for row, length in enumerate(lengths):
        audio[row, :length] = rng.standard_normal(length)
        mask[row, :length] = 1
    ours = np.asarray(hubert.layer_features(model, jnp.asarray(audio), jnp.asarray(mask), 1))
    plain = np.asarray(model.hidden_states(jnp.asarray(audio), jnp.asarray(mask))[0][1])
    for row, length in enumerate(lengths):
        with torch.no_grad():
            expected = reference(torch.tensor(audio[None, row, :length]),
                                 output_hidden_states=True).hidden_states[1][0].numpy()
        frames = int(feature_lengths(model.config, length))
        assert expected.shape[0] == frames
        np.testing.assert_allclose(ours[row, :frames], expected, atol=1e-5, rtol=1e-5)
        if row:  # padded rows
            assert np.abs(plain[row, :frames] - expected).max() > 1e-3


@pytest.fixture(scope="module")
def iterations(clips, tmp_path_factory):  # noqa: F811
    """A tiny iteration-1 run (MFCC targets) and the iteration-2 run on its first block's
    hidden states, both trained for TINY's 3 steps: (iteration-1 workdir, iteration-2 trainer,
    its summary, the records of both splits)."""
    root = tmp_path_factory.mktemp("iterations")
    Trainer(make_config("hubert_tiny", {**TINY, **clips}), root / "w1").run()
    config = make_config("hubert_tiny", {**ITERATION2, **clips,
                                         "objective.target_model": str(root / "w1")})
    trainer = Trainer(config, root / "w2")
    summary = trainer.run()
    records = hubert.prepare_hubert(config.data, config.examples, Path(config.data.cache_dir),
                                    config.train.seed)
    return root / "w1", trainer, summary, records


def test_iteration2_labels_are_the_nearest_centroids_of_the_teachers_features(iterations):
    """The iteration-2 run trains on finite losses; its labels (read back from the cache, not
    recomputed) are, frame for frame, the nearest of MiniBatchKMeans' centroids (fitted on the
    teacher's block-1 features of every training utterance, numpy distances), one per 5 ms
    network frame of each whole utterance; the held-out batch's frame t carries label t."""
    first, trainer, summary, records = iterations
    assert np.isfinite(summary["eval"]["loss"]) and summary["step"] == 3
    data, objective, model = trainer.data, trainer.objective, trainer.model_config
    train_records, held_out_records = records.train, records.eval
    teacher = load_pretrained(first)
    assert isinstance(teacher, Hubert)
    features = hubert.teacher_features(model, trainer.example_config, objective, load_pretrained)
    assert features.rate == 200  # 16 kHz / 80 samples a frame
    cached = sorted(Path(train_records.directory).glob("hubert_targets_*.npz"))
    train, held_out = hubert.cluster_targets(train_records, held_out_records, 8, objective,
                                             features)
    assert sorted(Path(train_records.directory).glob("hubert_targets_*.npz")) == cached
    assert train.label_rate == 200
    by_index = dict(features.of(train_records, range(len(train_records))))
    for index in range(len(train_records)):
        audio = train_records.spec.decode(train_records.source[index])["audio"]
        assert by_index[index].shape == (feature_lengths(teacher.config, len(audio)), 64)
    sample = np.concatenate([by_index[i] for i in range(len(train_records))])
    centroids = hubert.fit_kmeans(sample, 8, objective, hubert.KMEANS_SEED)
    distances = ((sample[:, None, :] - centroids[None]) ** 2).sum(-1)
    np.testing.assert_array_equal(train.labels, distances.argmin(1))
    assert len(np.unique(train.labels)) == 8
    windows = held_out_records.spaced_indices(trainer.example_config.max_eval_examples)
    for row, index in enumerate(windows):
        labels = held_out.of(index)[:data.eval["cluster_labels"].shape[1]]
        np.testing.assert_array_equal(data.eval["cluster_labels"][row, :len(labels)], labels)


def test_another_teacher_prepares_other_targets(iterations, tmp_path):
    """A different teacher (an HF `HubertModel` folder of other weights) has another identity,
    so its targets are clustered anew into a second cache file, while the same teacher read
    again, or its bfloat16 copy (run in float32), keeps its identity."""
    first, trainer, _, records = iterations
    model, examples = trainer.model_config, trainer.example_config
    teacher = load_pretrained(first)
    half = nnx.eval_shape(lambda: Hubert(dataclasses.replace(teacher.config, dtype="bfloat16"),
                                         rngs=nnx.Rngs(0)))
    nnx.update(half, nnx.state(teacher, nnx.Param))
    other = Hubert(model, rngs=nnx.Rngs(7))
    hf.save(other, tmp_path / "other")
    objective = trainer.objective
    named = hubert.teacher_features(model, examples, objective, load_pretrained).name
    assert hubert.teacher_features(model, examples, objective, load_pretrained).name == named
    # A bfloat16 copy runs in float32 (dump_hubert_feature.py), so it is the same teacher.
    assert hubert.teacher_features(model, examples, objective, lambda path: half).name == named
    swapped = dataclasses.replace(objective, target_model=str(tmp_path / "other"))
    with pytest.warns(UserWarning):  # the head HF has no class for
        features = hubert.teacher_features(model, examples, swapped, load_pretrained)
    assert features.name != named
    before = len(list(Path(records.train.directory).glob("hubert_targets_*.npz")))
    hubert.cluster_targets(records.train, records.eval, 8, swapped, features)
    assert len(list(Path(records.train.directory).glob("hubert_targets_*.npz"))) == before + 1


def test_refusals(iterations, tmp_path):
    """One-line refusals: no target model, a path that is not a directory, a layer past the
    teacher's blocks, a model that is not a speech network, a teacher whose frames are longer
    than the model's, an unknown kind of targets."""
    trainer = iterations[1]
    model, examples, objective = trainer.model_config, trainer.example_config, trainer.objective

    def refused(match: str, load=load_pretrained, **changes) -> None:
        with pytest.raises(UserError, match=match) as error:
            hubert.teacher_features(model, examples, dataclasses.replace(objective, **changes),
                                    load)
        assert "\n" not in str(error.value)

    refused("needs objective.target_model", target_model="")
    refused("is not a directory", target_model=str(tmp_path / "missing"))
    refused("past the 2 blocks", target_layer=3)
    refused("not a HuBERT", load=lambda path: nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    strides = HubertConfig(**{**TINY_SPEECH_ENCODER, "conv_strides": (5, 4, 2)})
    hf.save(Hubert(strides, rngs=nnx.Rngs(0)), tmp_path / "strides")
    with pytest.warns(UserWarning):
        refused("would not align", target_model=str(tmp_path / "strides"))
    with pytest.raises((UserError, ValueError), match="targets='words' must be one of"):
        make_config("hubert_tiny", {"objective.targets": "words"})
