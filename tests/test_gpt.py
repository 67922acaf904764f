"""GPT-2: parity with transformers `GPT2LMHeadModel` (forward, export round trip, greedy
`generate`), key/value-cache decoding, sampling filters against transformers' warpers, the
byte-level BPE tokenizer against transformers' `GPT2Tokenizer`, causal-LM blocks and loss,
causal masking, GPT-2's init, and a tiny model trained through the Trainer on a (2, 2, 2) mesh
whose workdir `run.py generate` continues."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity_utils import Parity, assert_close, converted, random_model

from pretext_jax import run
from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import gpt as gpt_examples
from pretext_jax.input_pipeline.tokenizers import ByteLevelBPETokenizer, load_tokenizer
from pretext_jax.models.generate import Sampling, filter_logits, generate, left_pad
from pretext_jax.models.gpt import GPT, GPTConfig
from pretext_jax.objectives.gpt import causal_lm_loss
from pretext_jax.pretrain import hf
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.trainer import Trainer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CONFIGS = [
    dict(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=48),
    dict(vocab_size=64, n_embd=24, n_layer=3, n_head=2, n_positions=40, n_inner=40,
         activation_function="relu", layer_norm_epsilon=1e-6),
]


def hf_logits(model, ids, mask, positions=None):
    return {"logits": model(input_ids=ids, attention_mask=mask, position_ids=positions).logits}


def model_logits(model, ids, mask, positions=None):
    positions = jnp.arange(ids.shape[1])[None] if positions is None else positions
    return {"logits": model(ids, mask, position_ids=positions)}


GPT2 = Parity("GPT2LMHeadModel", hf_logits, model_logits)


def hf_gpt2(seed: int, **config):
    return GPT2.reference(seed, **config, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def our_logits(model, ids, mask, positions=None) -> np.ndarray:
    return GPT2.our_outputs(model, ids, mask, positions)["logits"]


def batch(vocab_size: int, seed: int = 0, left: bool = False):
    """[3, 17] ids; rows 1 and 2 padded (at the end, or at the start when `left`)."""
    ids = np.random.default_rng(seed).integers(0, vocab_size, (3, 17))
    mask = np.ones((3, 17), np.int64)
    for row, length in ((1, 11), (2, 5)):
        if left:
            mask[row, :17 - length] = 0
        else:
            mask[row, length:] = 0
    return ids, mask


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(HF model, our model loaded from its saved folder, the folder) for CONFIGS[0]."""
    folder = tmp_path_factory.mktemp("gpt2")
    model = hf_gpt2(0, **CONFIGS[0])
    return model, converted(model, folder), folder


@pytest.mark.usefixtures("deterministic_torch")
@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_parity_with_hf_gpt2_lm_head_model(index, reference, tmp_path):
    if index == 0:
        theirs, ours, _ = reference
    else:
        theirs = hf_gpt2(index, **CONFIGS[index])
        ours = converted(theirs, tmp_path)
        assert ours.config.hidden_act == "relu" and ours.config.intermediate_size == 40
    vocab = CONFIGS[index]["vocab_size"]
    # Right padding: every position equals HF's (pad queries still see the real keys before).
    GPT2.assert_parity(ours, theirs, *batch(vocab, index))
    # Left padding: the real tokens' logits; a pad query sees no key at all, which HF's SDPA
    # and our attention fill differently (meaningless rows, never used). Given position ids
    # (generate's cumsum of the mask) are used as HF uses them.
    ids, mask = batch(vocab, index, left=True)
    real = mask.astype(bool)
    for positions in (None, np.maximum(np.cumsum(mask, 1) - 1, 0)):
        assert_close({"logits": our_logits(ours, ids, mask, positions)[real]},
                     {"logits": GPT2.hf_outputs(theirs, ids, mask, positions)["logits"][real]})


def random_gpt(seed: int, **fields) -> GPT:
    return random_model(GPT, GPTConfig(**fields), seed)


@pytest.mark.usefixtures("deterministic_torch")
def test_our_model_round_trips_through_transformers(tmp_path):
    ours = random_gpt(1, vocab_size=50, hidden_size=24, num_layers=2, num_heads=3,
                      intermediate_size=40, max_position_embeddings=20, hidden_act="gelu_tanh",
                      layer_norm_eps=1e-6, hidden_dropout=0.2, attention_dropout=0.3,
                      embedding_dropout=0.05, eos_token_id=7)
    reloaded, saved = GPT2.round_trip(ours, tmp_path / "exported", *batch(50, 2))
    assert saved["eos_token_id"] == 7
    assert (reloaded.config.embd_pdrop, reloaded.config.attn_pdrop) == (0.05, 0.3)


@pytest.mark.usefixtures("deterministic_torch")
def test_greedy_generation_equals_hf_generate(reference):
    theirs, ours, _ = reference
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(1, 97, n)) for n in (6, 11, 1, 8)]
    ids, mask = left_pad(prompts, pad_id=0)
    new = generate(ours, ids, mask, max_new_tokens=14, sampling=Sampling(greedy=True))
    with torch.no_grad():
        expected = theirs.generate(
            input_ids=torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long), do_sample=False,
            max_new_tokens=14, pad_token_id=0, eos_token_id=None)[:, ids.shape[1]:].numpy()
    np.testing.assert_array_equal(new, expected)
    # An end-of-text id: rows stop there (kept) and are padded after, as HF's.
    eos = int(expected[1, 5])
    stopped = generate(ours, ids, mask, max_new_tokens=14, sampling=Sampling(greedy=True),
                       eos_id=eos, pad_id=0)
    with torch.no_grad():
        expected = theirs.generate(
            input_ids=torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long), do_sample=False,
            max_new_tokens=14, pad_token_id=0, eos_token_id=eos)[:, ids.shape[1]:].numpy()
    expected = np.pad(expected, ((0, 0), (0, 14 - expected.shape[1])))  # HF stops when all did
    np.testing.assert_array_equal(stopped, expected)
    assert (stopped[1, 6:] == 0).all()


_prefill = nnx.jit(lambda model, ids, mask, length: model.prefill(ids, mask, length),
                   static_argnums=3)
_decode = nnx.jit(lambda model, *args: model.decode(*args))


@pytest.mark.parametrize("scan_layers", [True, False])
def test_kv_cache_decoding_equals_recomputing_the_forward(reference, scan_layers):
    """prefill + one cached decode step per token gives the logits of the full forward over the
    whole (left-padded) sequence at every new position."""
    model = hf.load(reference[2], scan_layers=scan_layers)
    ids = np.random.default_rng(4).integers(0, 97, (3, 17))
    mask = (np.arange(17)[None] >= np.array([[0], [3], [6]])).astype(np.int64)  # left pads
    prompt, total = 9, 17
    full = our_logits(model, ids, mask, np.maximum(np.cumsum(mask, 1) - 1, 0))
    logits, cache = _prefill(model, jnp.asarray(ids[:, :prompt]), jnp.asarray(mask[:, :prompt]),
                             total)
    np.testing.assert_allclose(logits, full[:, prompt - 1], atol=1e-5, rtol=0)
    key_mask = np.concatenate([mask[:, :prompt], np.zeros((3, total - prompt), np.int64)], 1)
    position = mask[:, :prompt].sum(1)
    for slot in range(prompt, total):
        key_mask[:, slot] = 1
        logits, cache = _decode(model, jnp.asarray(ids[:, slot]), jnp.asarray(position), cache,
                                jnp.int32(slot), jnp.asarray(key_mask, bool))
        np.testing.assert_allclose(logits, full[:, slot], atol=1e-5, rtol=0, err_msg=str(slot))
        position = position + 1


def test_sampling_filters_equal_transformers_warpers():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = np.random.default_rng(5).normal(0, 2, (6, 40)).astype(np.float32)
    for temperature, top_k, top_p in ((1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8),
                                      (0.5, 12, 0.6), (1.0, 1, 1.0), (2.0, 40, 0.05)):
        scores = TemperatureLogitsWarper(temperature)(None, torch.tensor(logits))
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1:
            scores = TopPLogitsWarper(top_p)(None, scores)
        ours = np.asarray(filter_logits(jnp.asarray(logits), jnp.float32(temperature),
                                        jnp.int32(top_k), jnp.float32(top_p)))
        kept = np.isfinite(scores.numpy())
        np.testing.assert_array_equal(np.isfinite(ours), kept, err_msg=str((top_k, top_p)))
        np.testing.assert_allclose(ours[kept], scores.numpy()[kept], rtol=1e-6)


def test_sampling_draws_from_the_filtered_distribution_and_repeats_per_seed(reference):
    _, model, _ = reference
    ids = np.full((4000, 3), 5, np.int32)  # one prompt, many draws of the next token
    logits = our_logits(model, ids[:1], np.ones((1, 3), np.int32))[0, -1]
    setting = Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=11)
    draws = generate(model, ids, max_new_tokens=1, sampling=setting)[:, 0]
    expected = np.asarray(jax.nn.softmax(filter_logits(
        jnp.asarray(logits)[None], 0.8, jnp.int32(20), jnp.float32(0.9))))[0]
    counts = np.bincount(draws, minlength=97) / len(draws)
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(expected))
    assert np.abs(counts - expected).max() < 4 * math.sqrt(0.25 / len(draws))
    again = generate(model, ids[:3], max_new_tokens=10, sampling=setting)
    np.testing.assert_array_equal(again, generate(model, ids[:3], max_new_tokens=10,
                                                  sampling=setting))
    other = generate(model, ids[:3], max_new_tokens=10, sampling=Sampling(seed=12))
    assert not np.array_equal(again, other)
    greedy = generate(model, ids[:3], max_new_tokens=10, sampling=Sampling(greedy=True))
    np.testing.assert_array_equal(
        generate(model, ids[:3], max_new_tokens=10, sampling=Sampling(top_k=1, seed=3)), greedy)


def test_causal_masking_and_padding(reference):
    _, model, _ = reference
    ids, mask = batch(97, 6)
    base = our_logits(model, ids, mask)
    changed = ids.copy()
    changed[:, 8] = (changed[:, 8] + 1) % 97
    after = our_logits(model, changed, mask)
    np.testing.assert_array_equal(after[0, :8], base[0, :8])  # the past does not see it
    assert np.abs(after[0, 8:] - base[0, 8:]).min(axis=-1).max() > 0  # the future does
    # A padded token changes no real position's logits.
    padded = ids.copy()
    padded[2, 5:] = (padded[2, 5:] + 3) % 97
    np.testing.assert_array_equal(our_logits(model, padded, mask)[2, :5], base[2, :5])


def test_init_follows_gpt2():
    """N(0, 0.02) weights, residual projections N(0, 0.02 / sqrt(2 n_layer)), not truncated."""
    model = GPT(GPTConfig(vocab_size=300, hidden_size=256, num_layers=8, num_heads=4,
                          intermediate_size=256, max_position_embeddings=64), rngs=nnx.Rngs(0))
    residual = 0.02 / math.sqrt(16)
    for kernel, std in ((model.layers.c_attn.kernel, 0.02), (model.layers.c_fc.kernel, 0.02),
                        (model.layers.attn_proj.kernel, residual),
                        (model.layers.mlp_proj.kernel, residual), (model.wte.embedding, 0.02),
                        (model.wpe.embedding, 0.02)):
        values = np.asarray(kernel[...]).ravel()
        assert abs(values.std() / std - 1) < 0.02 and abs(values.mean()) < 0.05 * std
        assert abs(np.mean(np.abs(values) > 2 * std) - 0.0455) < 0.006  # normal tails
    assert not np.asarray(model.layers.c_attn.bias[...]).any()


def test_blocks_cover_the_stream_once_with_end_of_text_between_documents():
    eos, pad, length = 99, 0, 5
    documents = [[[1, 2, 3], [4]], [[5, 6]], [[7, 8, 9, 10, 11, 12, 13]], [[14]]]
    stream = gpt_examples.token_stream(documents, eos)
    np.testing.assert_array_equal(stream, [1, 2, 3, 4, 99, 5, 6, 99, 7, 8, 9, 10, 11, 12, 13,
                                           99, 14])
    blocks = list(gpt_examples.blocks(stream, length, pad))
    assert len(blocks) == math.ceil((len(stream) - 1) / length) == 4
    targets = np.concatenate([b["tokens"][1:][b["token_mask"][1:] == 1] for b in blocks])
    np.testing.assert_array_equal(targets, stream[1:])  # every token but the first, once
    inputs = np.concatenate([b["tokens"][:-1][b["token_mask"][1:] == 1] for b in blocks])
    np.testing.assert_array_equal(inputs, stream[:-1])  # ... each predicted from its previous
    for block in blocks:
        assert block["tokens"].shape == block["token_mask"].shape == (length + 1,)
    assert blocks[1]["tokens"][0] == blocks[0]["tokens"][-1]  # consecutive blocks share one
    np.testing.assert_array_equal(blocks[2]["tokens"], [9, 10, 11, 12, 13, 99])
    np.testing.assert_array_equal(blocks[-1]["tokens"], [99, 14, 0, 0, 0, 0])
    np.testing.assert_array_equal(blocks[-1]["token_mask"], [1, 1, 0, 0, 0, 0])
    assert list(gpt_examples.blocks(np.arange(6), length, pad))[0]["token_mask"].all()
    assert not list(gpt_examples.blocks(np.arange(1), length, pad))


def test_causal_lm_loss_against_numpy(reference):
    _, model, _ = reference
    rng = np.random.default_rng(8)
    tokens = rng.integers(0, 97, (3, 10)).astype(np.int32)
    token_mask = np.ones((3, 10), np.int32)
    token_mask[2, 6:] = 0
    loss, metrics = causal_lm_loss(model, {"tokens": jnp.asarray(tokens),
                                           "token_mask": jnp.asarray(token_mask)}, None)
    logits = our_logits(model, tokens[:, :-1], token_mask[:, :-1]).astype(np.float64)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_probs, tokens[:, 1:, None], -1)[..., 0]
    weight = token_mask[:, 1:]
    assert weight.sum() == 3 * 9 - 4
    np.testing.assert_allclose(metrics["loss"][0], (nll * weight).sum(), rtol=1e-5)
    assert float(metrics["loss"][1]) == weight.sum()
    correct = (logits.argmax(-1) == tokens[:, 1:]) * weight
    assert float(metrics["accuracy"][0]) == correct.sum()
    np.testing.assert_allclose(loss, (nll * weight).sum() / weight.sum(), rtol=1e-5)


TRICKY = ["Café Ünïcode naïve résumé", "中文字 mixed with English 😀🎉",
          "tab\tand\nnewline  spaces   \n\n  x", "control\x00chars\x07here\ufffd\x1c\x1d",
          "punctuation!!!???...,,,;;", "a" * 120, "", "   ", " leading", "trailing   ",
          "Mr. O'Neil's e-mail: it's they're I'll we've 'd 'S", "ＦＵＬＬ　ｗｉｄｔｈ",
          "123 4567 ½ ² ٣", "x<|endoftext|>y", "\u2028line\u2029para\u00a0nbsp\u3000", "a\r\nb",
          "𝔘𝔫𝔦 a \u0301b \u0301\u0301c"]


@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory):
    """vocab.json + merges.txt trained with HF `tokenizers` on lines of the Python docs' raw
    reference topics (prose, indented code, whitespace runs)."""
    tokenizers = pytest.importorskip("tokenizers")
    from pydoc_data.topics import topics

    folder = tmp_path_factory.mktemp("bpe")
    lines = [line for name in sorted(topics)[:80] for line in topics[name].splitlines()]
    trainer = tokenizers.ByteLevelBPETokenizer()
    trainer.train_from_iterator(lines + TRICKY, vocab_size=700, min_frequency=2,
                                special_tokens=["<|endoftext|>"], show_progress=False)
    trainer.save_model(str(folder))
    return folder, lines


def test_byte_level_bpe_equals_transformers_gpt2_tokenizer(bpe_folder):
    folder, lines = bpe_folder
    ours = load_tokenizer(folder)
    assert isinstance(ours, ByteLevelBPETokenizer)
    theirs = transformers.GPT2Tokenizer.from_pretrained(folder)
    for text in lines[:1500] + TRICKY:
        assert ours.encode(text) == theirs.encode(text), repr(text)
        assert ours.decode(ours.encode(text)) == text, repr(text)
    eot = theirs.convert_tokens_to_ids("<|endoftext|>")
    assert ours.eos_id == ours.pad_id == ours.sep_id == eot and ours.special_ids == {eot}
    assert ours.vocab_size == len(theirs)
    assert load_tokenizer(folder / "vocab.json").encode("x y") == ours.encode("x y")
    assert not ours.continuation[ours.encode(" word")[0]]


def test_byte_level_bpe_bad_folders(bpe_folder, tmp_path):
    folder, _ = bpe_folder
    (tmp_path / "vocab.json").write_text((folder / "vocab.json").read_text())
    (tmp_path / "merges.txt").write_text("#version: 0.2\nĠ t\nthree parts here\n")
    with pytest.raises(UserError, match="line 3"):
        load_tokenizer(tmp_path)
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, "b": 1}))
    (tmp_path / "merges.txt").write_text("a b\n")
    with pytest.raises(UserError, match="endoftext"):
        load_tokenizer(tmp_path)


def test_tiny_gpt_trains_on_a_mixed_mesh_and_generates(tmp_path, capsys):
    steps = 30
    config = make_config("gpt_tiny", {
        "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "train.steps": steps,
        "optim.warmup_steps": 10,
        "train.log_every": 10, "train.eval_every": steps, "train.checkpoint_every": steps,
        "train.eval_batches": 2, "train.progress": False})
    trainer = Trainer(config, tmp_path / "run")
    assert trainer.data.report["end_of_text_id"] == trainer.model_config.eos_token_id == 3
    trainer.run()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    train = [r["loss"] for r in records if r["split"] == "train"]
    final = next(r for r in records if r["split"] == "eval")
    vocab = trainer.model_config.vocab_size
    assert train[0] > math.log(vocab) - 0.3  # starts near uniform over the vocabulary
    assert train[-1] < train[0] - 1.0 and final["loss"] < math.log(vocab) - 1.0, train
    capsys.readouterr()
    workdir = str(tmp_path / "run")
    assert run.main(["generate", "--workdir", workdir, "--prompt", "The list",
                     "--prompt", "", "--max-new-tokens", "12", "--top-k", "20",
                     "--seed", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("The list") and len(lines[0]) > len("The list") + 5, lines
    assert run.main(["generate", "--workdir", workdir, "--prompt", "x",
                     "--max-new-tokens", "500"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "context of 128" in err, err
    with pytest.raises(SystemExit) as exit_info:  # refused by the argument parser
        run.main(["generate", "--workdir", workdir, "--prompt", "x", "--top-p", "1.5"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "top-p" in err and err.count("\n") == 1
