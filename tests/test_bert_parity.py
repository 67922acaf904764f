"""Parity with HF transformers `BertForPreTraining` (random init, float32, padded batches), and
the HF round trips, storage formats and error cases of `pretrain.hf`."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from parity_utils import (
    MASKED_POSITIONS,
    assert_close,
    assert_gathered,
    assert_same_params,
    converted,
    encoder_pretraining,
    padded_inputs,
    random_model,
)
from safetensors.numpy import load_file

from pretext_jax.errors import UserError
from pretext_jax.models.bert import Bert
from pretext_jax.models.encoder import EncoderConfig
from pretext_jax.pretrain import hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CONFIGS = [
    dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
         intermediate_size=37, max_position_embeddings=40, type_vocab_size=2,
         hidden_act="gelu"),
    dict(vocab_size=128, hidden_size=48, num_hidden_layers=3, num_attention_heads=2,
         intermediate_size=64, max_position_embeddings=40, type_vocab_size=3,
         hidden_act="gelu_new", layer_norm_eps=1e-7),
    dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
         intermediate_size=16, max_position_embeddings=24, type_vocab_size=2,
         hidden_act="relu"),
]


pytestmark = pytest.mark.usefixtures("deterministic_torch")


BERT = encoder_pretraining("BertForPreTraining")


def batch(config: dict, seed: int = 0):
    return padded_inputs(config["vocab_size"], config["type_vocab_size"], seed)


@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_parity_with_hf_bert_for_pretraining(index, tmp_path):
    config = CONFIGS[index]
    reference = BERT.reference(index, **config)
    model = converted(reference, tmp_path)
    assert model.config.hidden_act == {"gelu": "gelu", "gelu_new": "gelu_tanh",
                                       "relu": "relu"}[config["hidden_act"]]
    inputs = batch(config, index)
    expected = BERT.assert_parity(model, reference, *inputs)
    # The masked-LM head at `masked_positions` equals the full logits gathered there.
    gathered = model(*map(jnp.asarray, inputs), masked_positions=jnp.asarray(MASKED_POSITIONS))
    assert_gathered(gathered.mlm_logits, expected["mlm_logits"])


def test_python_loop_and_remat_compute_the_same(tmp_path):
    config = CONFIGS[1]
    inputs = batch(config, 1)
    scanned = BERT.our_outputs(converted(BERT.reference(1, **config), tmp_path), *inputs)
    looped = hf.load(tmp_path, scan_layers=False, remat="full")
    assert not looped.config.scan_layers and looped.config.remat == "full"
    assert_close(BERT.our_outputs(looped, *inputs), scanned, atol=1e-6)


def random_bert(seed: int, **fields) -> Bert:
    return random_model(Bert, EncoderConfig(**fields), seed)


def test_our_model_round_trips_through_transformers(tmp_path):
    """hf.save -> transformers (all keys, our outputs) -> hf.load: the very same model."""
    ours = random_bert(0, vocab_size=50, hidden_size=24, num_layers=2, num_heads=3,
                       intermediate_size=40, max_position_embeddings=20, type_vocab_size=3,
                       hidden_act="gelu_tanh", layer_norm_eps=1e-6, hidden_dropout=0.2,
                       attention_dropout=0.3, initializer_range=0.05)
    reloaded, _ = BERT.round_trip(ours, tmp_path / "exported",
                                  *batch(dict(vocab_size=50, type_vocab_size=3), 5))
    assert reloaded.config.hidden_act == "gelu_new" and reloaded.config.layer_norm_eps == 1e-6


def test_hf_load_save_gives_identical_tensors(tmp_path):
    reference = BERT.reference(3, **CONFIGS[0])
    reference.save_pretrained(tmp_path / "hf")
    hf.save(hf.load(tmp_path / "hf"), tmp_path / "exported")
    theirs, ours = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "exported"))
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    reloaded = transformers.BertForPreTraining.from_pretrained(tmp_path / "exported")
    expected = reference.state_dict()
    assert sorted(reloaded.state_dict()) == sorted(expected)
    for name, tensor in reloaded.state_dict().items():  # includes the tied decoder tensors
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)


def test_pytorch_bin_sharded_and_bfloat16_checkpoints(tmp_path):
    config = CONFIGS[0]
    reference = BERT.reference(7, **config)
    reference.save_pretrained(tmp_path / "safetensors")
    single = hf.load(tmp_path / "safetensors")
    # transformers 5 has no safe_serialization=False any more: write the .bin by hand.
    (tmp_path / "bin").mkdir()
    reference.config.save_pretrained(tmp_path / "bin")
    torch.save(reference.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    from_bin = hf.load(tmp_path / "bin")
    inputs = batch(config, 2)
    BERT.assert_parity(from_bin, reference, *inputs)
    assert_same_params(from_bin, single)
    reference.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert_same_params(hf.load(tmp_path / "sharded"), single)
    reference.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    bf16 = hf.load(tmp_path / "bf16")
    embedding = bf16.encoder.embeddings.word_embeddings.embedding.get_value()
    assert embedding.dtype == jnp.float32
    np.testing.assert_array_equal(
        embedding, reference.bert.embeddings.word_embeddings.weight.detach().float().numpy())


def test_bare_and_legacy_checkpoints(tmp_path):
    config = CONFIGS[0]
    reference = BERT.reference(8, **config)
    inputs = batch(config, 3)
    expected = BERT.hf_outputs(reference, *inputs)
    # BertModel: no "bert." prefix, no pre-training heads -> encoder + pooler, heads at init.
    reference.bert.save_pretrained(tmp_path / "bare")
    with pytest.warns(UserWarning, match="has no cls.predictions, cls.seq_relationship;"):
        bare = hf.load(tmp_path / "bare")
    np.testing.assert_allclose(BERT.our_outputs(bare, *inputs)["hidden_states"],
                               expected["hidden_states"], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(bare.lm_head.bias.get_value(), np.zeros(config["vocab_size"]))
    # An old-style checkpoint: TF LayerNorm names, explicit tied decoder tensors (no
    # cls.predictions.bias), the position_ids buffer, and a classifier we have no place for.
    state = {k.replace("LayerNorm.weight", "LayerNorm.gamma")
              .replace("LayerNorm.bias", "LayerNorm.beta"): v.numpy()
             for k, v in reference.state_dict().items()}
    state["cls.predictions.decoder.bias"] = state.pop("cls.predictions.bias")
    state["bert.embeddings.position_ids"] = np.arange(40)[None]
    state["classifier.weight"] = np.zeros((2, config["hidden_size"]), np.float32)
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    reference.config.save_pretrained(legacy)
    torch.save({k: torch.from_numpy(v) for k, v in state.items()}, legacy / "pytorch_model.bin")
    assert "cls.predictions.decoder.weight" in state
    with pytest.warns(UserWarning) as record:
        model = hf.load(legacy)
    assert [str(w.message).split(": ", 1)[1] for w in record] == [
        "ignoring 1 tensors that Bert has no place for: classifier.weight"]
    assert_close(BERT.our_outputs(model, *inputs), expected)
    # An untied decoder weight cannot be represented: say so.
    del state["classifier.weight"]
    state["cls.predictions.decoder.weight"] = state["cls.predictions.decoder.weight"] + 1
    with pytest.warns(UserWarning, match="decoder.weight differs"):
        hf.from_hf(reference.config.to_dict(), state)


def test_bad_checkpoints_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="missing is not a directory"):
        hf.load(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="has no config.json"):
        hf.load(tmp_path / "empty")
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(UserError, match="model_type 'llama' is not supported"):
        hf.load(tmp_path / "llama")
    BERT.reference(0, **CONFIGS[0]).save_pretrained(tmp_path / "shape")
    (tmp_path / "shape" / "model.safetensors").rename(tmp_path / "weights.safetensors")
    with pytest.raises(UserError, match="no model.safetensors or pytorch_model.bin"):
        hf.load(tmp_path / "shape")
    (tmp_path / "weights.safetensors").rename(tmp_path / "shape" / "model.safetensors")
    config_file = tmp_path / "shape" / "config.json"
    config_file.write_text(config_file.read_text().replace('"intermediate_size": 37',
                                                           '"intermediate_size": 38'))
    with pytest.raises(UserError, match=r"intermediate.dense.weight has shape \(37, 32\) but "
                                        r"config.json implies \(38, 32\)"):
        hf.load(tmp_path / "shape")
    state = load_file(tmp_path / "shape" / "model.safetensors")
    del state["bert.encoder.layer.1.output.dense.bias"]
    with pytest.raises(UserError, match="lacks bert.encoder.layer.1.output.dense.bias"):
        hf.from_hf(CONFIGS[0] | {"model_type": "bert"}, state)


def test_save_never_clobbers_unrelated_files(tmp_path):
    model = random_bert(1, vocab_size=20, hidden_size=8, num_layers=1, num_heads=2,
                        intermediate_size=8, max_position_embeddings=8)
    unrelated = tmp_path / "unrelated"
    unrelated.mkdir()
    (unrelated / "thesis.tex").write_text("precious")
    (unrelated / "config.json").write_text('{"steps": 10}')  # e.g. a pretext workdir
    with pytest.raises(UserError, match="not a HuggingFace checkpoint"):
        hf.save(model, unrelated)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unrelated"]  # no temp dir left
    assert sorted(p.name for p in unrelated.iterdir()) == ["config.json", "thesis.tex"]
    assert (unrelated / "thesis.tex").read_text() == "precious"
    assert (unrelated / "config.json").read_text() == '{"steps": 10}'
    # Overwriting a HF checkpoint replaces its weights and keeps its other files.
    target = tmp_path / "hf"
    BERT.reference(0, **CONFIGS[2]).save_pretrained(target)
    (target / "vocab.txt").write_text("[PAD]\n")
    torch.save({}, target / "pytorch_model.bin")
    hf.save(model, target)
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors",
                                                        "vocab.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "unrelated"]
    assert_same_params(hf.load(target), model)
