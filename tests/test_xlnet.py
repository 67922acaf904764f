"""XLNet: parity with HF `XLNetLMHeadModel` (two streams, segments, padding, memory over two
segments, bi_data, clamp_len, uni attention) and the HF round trip."""

from __future__ import annotations

import numpy as np
import pytest
from parity_utils import XLNET_LM, assert_close, converted, random_model

from pretext_jax.models.xlnet import XLNet, XLNetConfig
from pretext_jax.pretrain import hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("deterministic_torch")

# HF XLNetConfig fields.
CONFIGS = {
    "base-like": dict(vocab_size=61, d_model=32, n_layer=2, n_head=4, d_inner=48, mem_len=7,
                      reuse_len=5, ff_activation="gelu"),
    "bi_data+clamp": dict(vocab_size=50, d_model=24, n_layer=3, n_head=2, d_inner=40,
                          mem_len=6, reuse_len=0, bi_data=True, clamp_len=4,
                          ff_activation="relu", layer_norm_eps=1e-6),
    "uni+same_length": dict(vocab_size=40, d_model=16, n_layer=1, n_head=2, d_inner=16,
                            mem_len=5, attn_type="uni", same_length=True,
                            ff_activation="gelu_new"),
}
BATCH, SEQ, PREDICT = 4, 9, 3


def inputs(vocab_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Ids, 3 token types, padding in one row, a random perm_mask and one-hot targets."""
    rng = np.random.default_rng(seed)
    target_mapping = np.zeros((BATCH, PREDICT, SEQ), np.float32)
    for row in range(BATCH):
        target_mapping[row, np.arange(PREDICT), rng.choice(SEQ, PREDICT, replace=False)] = 1
    attention_mask = np.ones((BATCH, SEQ), np.int64)
    attention_mask[1, 7:] = 0
    return {"input_ids": rng.integers(0, vocab_size, (BATCH, SEQ)),
            "token_type_ids": rng.integers(0, 3, (BATCH, SEQ)),
            "attention_mask": attention_mask,
            "perm_mask": (rng.random((BATCH, SEQ, SEQ)) < 0.4).astype(np.float32),
            "target_mapping": target_mapping}


def hf_xlnet(name: str):
    return XLNET_LM.reference(0, **CONFIGS[name])


def assert_segments(model: XLNet, reference, segments) -> dict[str, np.ndarray]:
    """Each segment's (HF's inputs, our inputs) within 1e-5, each side attending to its own
    memory of the segment before; our last outputs."""
    their_mems = our_mems = ours = None
    for their_inputs, our_inputs in segments:
        theirs = XLNET_LM.hf_outputs(reference, their_inputs, their_mems)
        ours = XLNET_LM.our_outputs(model, our_inputs, our_mems)
        assert_close(ours, theirs)
        their_mems, our_mems = theirs["new_mems"], ours["new_mems"]
    return ours


# Which inputs each case passes: plain, segments only, padding + perm_mask (content stream
# with the permutation), everything (two streams with target_mapping).
CASES = {"plain": (), "segments": ("token_type_ids",),
         "perm_mask": ("token_type_ids", "attention_mask", "perm_mask"),
         "two_stream": ("token_type_ids", "attention_mask", "perm_mask", "target_mapping")}


# HF's `uni` path cannot add a padding/perm mask to its causal mask (an in-place broadcast in
# XLNetModel.forward fails), so `uni` is compared without them.
PAIRS = [(name, case) for name in CONFIGS for case in CASES
         if CONFIGS[name].get("attn_type") != "uni" or case in ("plain", "segments")]


@pytest.mark.parametrize(("name", "case"), PAIRS)
def test_parity_with_hf_over_two_segments(name, case, tmp_path):
    reference = hf_xlnet(name)
    model = converted(reference, tmp_path)
    assert isinstance(model, XLNet)
    vocab_size = CONFIGS[name]["vocab_size"]
    first, second = inputs(vocab_size, 0), inputs(vocab_size, 1)
    keys = ("input_ids", *CASES[case])
    first = {k: first[k] for k in keys}
    second = {k: second[k] for k in keys}
    # The second segment attends to the first one's memory.
    ours = assert_segments(model, reference, [(first, first), (second, second)])
    assert ours["new_mems"].shape[2] == CONFIGS[name]["mem_len"]


@pytest.mark.parametrize("name", ["base-like", "bi_data+clamp"])
def test_query_stream_at_target_positions_equals_hf_target_mapping(name, tmp_path):
    """`target_positions` attends from the P target rows only; the logits and memory over two
    segments equal HF's with the full one-hot `target_mapping`."""
    reference = hf_xlnet(name)
    model = converted(reference, tmp_path)
    segments = []
    for seed in (0, 1):
        batch = inputs(CONFIGS[name]["vocab_size"], seed)
        positions = {**batch, "target_positions": batch["target_mapping"].argmax(-1)}
        del positions["target_mapping"]
        segments.append((batch, positions))
    assert_segments(model, reference, segments)


def test_loop_and_remat_compute_the_same(tmp_path):
    batch = inputs(61, 2)
    scanned = XLNET_LM.our_outputs(converted(hf_xlnet("base-like"), tmp_path), batch)
    looped = XLNET_LM.our_outputs(hf.load(tmp_path, scan_layers=False, remat="full"), batch)
    assert_close(looped, scanned, atol=1e-6)


@pytest.mark.parametrize("untie_r", [True, False])
def test_round_trip_through_transformers(untie_r, tmp_path):
    config = XLNetConfig(vocab_size=45, hidden_size=24, num_layers=2, num_heads=3,
                         intermediate_size=30, mem_len=4, reuse_len=2, untie_r=untie_r,
                         hidden_dropout=0.0, attention_dropout=0.0)
    ours = random_model(XLNet, config, 3)
    _, saved = XLNET_LM.round_trip(ours, tmp_path, inputs(45, 4), untie_r=untie_r)
    assert saved["untie_r"] is untie_r
