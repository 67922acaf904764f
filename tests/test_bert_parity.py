"""Parity with HF transformers `BertForPreTraining` (random init, float32, padded batches), and
the HF round trips through `pretrain.hf.load/save`."""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from input_pipeline.errors import UserError
from pretrain import hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CONFIGS = [
    dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
         intermediate_size=37, max_position_embeddings=40, type_vocab_size=2,
         hidden_act="gelu"),
    dict(vocab_size=128, hidden_size=48, num_hidden_layers=3, num_attention_heads=2,
         intermediate_size=64, max_position_embeddings=40, type_vocab_size=3,
         hidden_act="gelu_new", layer_norm_eps=1e-7),
    dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=1,
         intermediate_size=16, max_position_embeddings=24, type_vocab_size=2,
         hidden_act="relu"),
]


def hf_model(seed: int, **config):
    torch.manual_seed(seed)
    model = transformers.BertForPreTraining(transformers.BertConfig(**config))
    model.eval()
    # Random init zeroes biases and sets LayerNorm to identity: perturb them so parity covers
    # every tensor.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def batch(config: dict, seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, config["vocab_size"], size=(3, 17))
    types = rng.integers(0, config["type_vocab_size"], size=(3, 17))
    mask = np.ones((3, 17), np.int64)
    mask[1, 11:] = 0
    mask[2, 5:] = 0
    return ids, types, mask


def hf_outputs(model, ids, types, mask):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), token_type_ids=torch.tensor(types),
                    attention_mask=torch.tensor(mask), output_hidden_states=True)
    return (out.hidden_states[-1].numpy(), out.prediction_logits.numpy(),
            out.seq_relationship_logits.numpy())


def our_outputs(model, ids, types, mask):
    out = model(jnp.asarray(ids), jnp.asarray(types), jnp.asarray(mask))
    return np.asarray(out.hidden_states), np.asarray(out.mlm_logits), np.asarray(out.nsp_logits)


def assert_close(ours, theirs, atol=1e-5):
    for name, a, b in zip(("hidden_states", "mlm_logits", "nsp_logits"), ours, theirs,
                          strict=True):
        np.testing.assert_allclose(a, b, atol=atol, rtol=0, err_msg=name)


@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_parity_with_hf_bert_for_pretraining(index, tmp_path):
    config = CONFIGS[index]
    reference = hf_model(index, **config)
    reference.save_pretrained(tmp_path)
    inputs = batch(config, index)
    expected = hf_outputs(reference, *inputs)
    assert_close(our_outputs(hf.load(tmp_path), *inputs), expected)
    # Loop instead of scan, and rematerialisation, compute the same numbers.
    assert_close(our_outputs(hf.load(tmp_path, scan_layers=False, remat="full"), *inputs),
                 expected)


def test_masked_positions_gather_equals_full_logits(tmp_path):
    hf_model(0, **CONFIGS[0]).save_pretrained(tmp_path)
    model = hf.load(tmp_path)
    ids, types, mask = batch(CONFIGS[0])
    positions = jnp.asarray([[1, 4, 9], [0, 2, 3], [7, 8, 16]])
    full = model(jnp.asarray(ids), jnp.asarray(types), jnp.asarray(mask)).mlm_logits
    gathered = model(jnp.asarray(ids), jnp.asarray(types), jnp.asarray(mask),
                     masked_positions=positions).mlm_logits
    np.testing.assert_allclose(gathered, np.take_along_axis(np.asarray(full),
                                                            np.asarray(positions)[..., None], 1),
                               atol=1e-6)


def test_save_round_trips_through_transformers(tmp_path):
    config = CONFIGS[1]
    hf_model(3, **config).save_pretrained(tmp_path / "hf")
    ours = hf.load(tmp_path / "hf")
    hf.save(ours, tmp_path / "exported")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded, info = transformers.BertForPreTraining.from_pretrained(
            tmp_path / "exported", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    reloaded.eval()
    inputs = batch(config, 5)
    assert_close(our_outputs(ours, *inputs), hf_outputs(reloaded, *inputs))
    original = transformers.BertForPreTraining.from_pretrained(tmp_path / "hf").state_dict()
    for name, tensor in reloaded.state_dict().items():
        np.testing.assert_array_equal(tensor.numpy(), original[name].numpy(), err_msg=name)


def test_pytorch_bin_and_bare_model_checkpoints(tmp_path):
    config = CONFIGS[0]
    reference = hf_model(7, **config)
    (tmp_path / "bin").mkdir()
    reference.config.save_pretrained(tmp_path / "bin")  # transformers 5 writes only safetensors
    torch.save(reference.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    inputs = batch(config, 2)
    assert_close(our_outputs(hf.load(tmp_path / "bin"), *inputs), hf_outputs(reference, *inputs))
    reference.bert.save_pretrained(tmp_path / "bare")  # BertModel: no prefix, no heads
    with pytest.warns(UserWarning, match="cls.predictions"):
        bare = hf.load(tmp_path / "bare")
    hidden = our_outputs(bare, *inputs)[0]
    np.testing.assert_allclose(hidden, hf_outputs(reference, *inputs)[0], atol=1e-5)


def test_bad_checkpoints_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="config.json"):
        hf.load(tmp_path / "missing")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(UserError, match="llama"):
        hf.load(tmp_path / "other")
    hf_model(0, **CONFIGS[0]).save_pretrained(tmp_path / "shape")
    config_file = tmp_path / "shape" / "config.json"
    config_file.write_text(config_file.read_text().replace('"hidden_size": 32',
                                                           '"hidden_size": 64'))
    with pytest.raises(UserError, match="shape"):
        hf.load(tmp_path / "shape")
    unrelated = tmp_path / "unrelated"
    unrelated.mkdir()
    (unrelated / "thesis.tex").write_text("precious")
    hf_model(0, **CONFIGS[0]).save_pretrained(tmp_path / "ok")
    with pytest.raises(UserError, match="not a HuggingFace checkpoint"):
        hf.save(hf.load(tmp_path / "ok"), unrelated)
    assert [p.name for p in unrelated.iterdir()] == ["thesis.tex"]
