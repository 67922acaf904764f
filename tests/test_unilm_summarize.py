"""UniLM's sequence-to-sequence fine-tuning and decoding (`summarize_unilm`:
models/prefix_lm.py, objectives/common/masked_targets.py): the incremental pseudo-mask decoder
against the full forward of the packed sequence, beam search against a plain-Python
re-statement of HF's search fed by that full forward, the masking against a re-statement of
unilm-v1's `Preprocess4Seq2seq` over many draws, the smoothed loss against unilm-v1's
`LabelSmoothingLoss` in torch, and the CLI from a `unilm` model directory: a few steps, the dev
ROUGE, an exact resume, the one-line refusals."""

from __future__ import annotations

import dataclasses
import json
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity_utils import Parity, converted, hf_reference, random_model
from test_beam_search import SEARCHES, ends, python_beam_search, sources
from test_summarize import LINE, assert_results_rouge, toy  # noqa: F401 (a fixture)

from pretext_jax import run
from pretext_jax.errors import UserError
from pretext_jax.models.beam_search import beam_search
from pretext_jax.models.bert import Bert
from pretext_jax.models.encoder import EncoderConfig
from pretext_jax.models.hf.bert import PREFIX_LM_FIELDS, PREFIX_LM_KEY
from pretext_jax.models.prefix_lm import PrefixLM, PrefixLMConfig
from pretext_jax.objectives.common import encoder_decoders as ed
from pretext_jax.objectives.common.masked_targets import (
    MaskedTargetSettings,
    sample_masks,
    smoothed_kl,
)
from pretext_jax.objectives.unilm import UnilmConfig
from pretext_jax.pretrain import directories, hf, loading
from pretext_jax.pretrain.export import save_model
from pretext_jax.pretrain.finetune import finetune_config
from pretext_jax.pretrain.trainer import Trainer

SOS, EOS, MASK, PAD = 2, 3, 4, 0
TINY = PrefixLMConfig(vocab_size=40, hidden_size=16, num_layers=2, num_heads=2,
                      intermediate_size=32, max_position_embeddings=32, hidden_dropout=0.0,
                      attention_dropout=0.0, sos_token_id=SOS, eos_token_id=EOS,
                      mask_token_id=MASK, pad_token_id=PAD)


@pytest.fixture(scope="module")
def tiny() -> PrefixLM:
    return PrefixLM(TINY, rngs=nnx.Rngs(0))


LENGTH = 12  # target positions of the full forward (later ones never affect earlier ones)


@nnx.jit
def _packed_logits(model: PrefixLM, ids: jax.Array, mask: jax.Array, block: jax.Array
                   ) -> jax.Array:
    return model(ids, mask, block)


def full_logits(model: PrefixLM, ids: np.ndarray, mask: np.ndarray, outputs: np.ndarray,
                last: int = MASK) -> np.ndarray:
    """The logits at target position t of the packed sequence whose target block is
    `outputs` [N, t] then `last` ([MASK]: unilm-v1's pseudo-token), by the full forward
    (the block padded to `LENGTH`, which the causal target mask keeps from position t)."""
    block = np.full((len(ids), LENGTH), PAD)
    block[:, :outputs.shape[1]] = outputs
    block[:, outputs.shape[1]] = last
    logits = _packed_logits(model, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(block))
    return np.asarray(logits[:, ids.shape[1] + 1 + outputs.shape[1]])


def test_incremental_decoding_equals_the_full_forward_at_every_step(tiny):
    """`encode`, `prefill_decoder` and `decode_step` fed each target token in turn give, at
    every step, the full forward's logits at the [MASK] after the packed prefix (sources of
    three lengths, so the target positions follow each row's own source); another token in
    the [MASK]'s place changes them (the pseudo-token is what is read)."""
    rng = np.random.default_rng(0)
    mask = (np.arange(7) < np.array([7, 4, 2])[:, None]).astype(np.int32)
    ids = rng.integers(5, 40, mask.shape) * mask
    outputs = rng.integers(5, 40, (3, 6))
    cache = tiny.prefill_decoder(tiny.encode(jnp.asarray(ids), jnp.asarray(mask)),
                                 jnp.asarray(mask), outputs.shape[1])
    previous = np.full(3, TINY.decoder_start_token_id)
    decode_step = nnx.jit(PrefixLM.decode_step)
    for step in range(outputs.shape[1]):
        logits, cache = decode_step(tiny, jnp.asarray(previous), jnp.int32(step), cache)
        expected = full_logits(tiny, ids, mask, outputs[:, :step])
        np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-5, err_msg=str(step))
        other = full_logits(tiny, ids, mask, outputs[:, :step], last=outputs[0, step])
        assert np.abs(other - expected).max() > 1e-3  # negative control
        previous = outputs[:, step]


def packed_for_hf(source: np.ndarray, source_mask: np.ndarray, targets: np.ndarray,
                  config: PrefixLMConfig) -> tuple[np.ndarray, ...]:
    """The packed sequence as HF BERT reads it: [SOS] + source + target ids, the source's and
    the target's token types, positions (the source block's 0.., the target's from the count
    of source tokens on), and the additive [B, 1, S, S] mask of unilm-v1 seq2seq_loader.py:
    every query sees the source's tokens, target queries also the target keys up to their
    own."""
    rows, width, length = source.shape[0], source.shape[1] + 1, targets.shape[1]
    ids = np.concatenate([np.full((rows, 1), config.sos_token_id), source, targets], axis=1)
    types = np.where(np.arange(width + length) < width, config.source_type_id,
                     config.target_type_id)[None].repeat(rows, 0)
    tokens = np.concatenate([np.ones((rows, 1), bool), source_mask.astype(bool)], axis=1)
    count = tokens.sum(1, keepdims=True)
    positions = np.concatenate([np.arange(width)[None].repeat(rows, 0),
                                count + np.arange(length)], axis=1)
    allowed = np.zeros((rows, width + length, width + length), bool)
    for b in range(rows):
        for i in range(width + length):
            for j in range(width + length):
                allowed[b, i, j] = (j < width and tokens[b, j]) or width <= j <= i
    bias = np.where(allowed, 0.0, np.finfo(np.float32).min).astype(np.float32)[:, None]
    return ids, types, positions, bias


def _hf_packed_logits(model, source, mask, targets, ids, types, positions, bias):
    return {"logits": model(input_ids=ids, token_type_ids=types, position_ids=positions,
                            attention_mask=bias).logits}


def _our_packed_logits(model, source, mask, targets, *hf_inputs):
    return {"logits": model(source, mask, targets)}


PREFIX_LM = Parity("BertForMaskedLM", _hf_packed_logits, _our_packed_logits)


def test_prefix_lm_is_hf_bert_for_masked_lm_under_the_seq2seq_mask(deterministic_torch,
                                                                     tmp_path):
    """HF has no UniLM class; UniLM's prefix LM is HF `BertForMaskedLM` fed the packed
    sequence's token types and positions and the seq2seq mask as a [B, 1, S, S] attention
    mask. Import (config.json's `prefix_lm` settings make it a PrefixLM), export (transformers
    reads every tensor) and the way back, within 1e-5; the same BertForMaskedLM without those
    settings still imports as a BERT (BERT checkpoints of that class stay BERTs)."""
    rng = np.random.default_rng(0)
    source, targets = rng.integers(5, 40, (3, 7)), rng.integers(5, 40, (3, 5))
    mask = np.ones((3, 7), np.int32)
    mask[1, 4:] = 0
    mask[2, 2:] = 0
    inputs = (source, mask, targets, *packed_for_hf(source, mask, targets, TINY))
    shape = {"vocab_size": 40, "hidden_size": 16, "num_hidden_layers": 2,
             "num_attention_heads": 2, "intermediate_size": 32, "max_position_embeddings": 32,
             "type_vocab_size": 6, "hidden_dropout_prob": 0.0,
             "attention_probs_dropout_prob": 0.0}
    settings = {name: getattr(TINY, name) for name in PREFIX_LM_FIELDS}
    reference = hf_reference("BertForMaskedLM", 0, **shape, **{PREFIX_LM_KEY: settings})
    model = converted(reference, tmp_path / "hf")
    assert type(model) is PrefixLM and model.config == TINY
    PREFIX_LM.assert_parity(model, reference, *inputs)
    _, saved = PREFIX_LM.round_trip(random_model(PrefixLM, TINY, 1), tmp_path / "out", *inputs)
    assert saved[PREFIX_LM_KEY] == settings

    plain = hf_reference("BertForMaskedLM", 0, **shape)
    plain.save_pretrained(tmp_path / "plain")
    with pytest.warns(UserWarning, match="pooler"):  # BertForMaskedLM has no pooler
        assert type(hf.load(tmp_path / "plain")) is Bert


def test_beam_search_equals_hf_search_on_the_full_forward():
    """`beam_search` through the cache equals HF's search re-stated in Python
    (tests/test_beam_search.py `python_beam_search`) whose log-probabilities are the full
    forward's at the [MASK] after each beam's prefix: tokens and scores, with a trigram ban, a
    minimum length and a length penalty (`SEARCHES["never"]`)."""
    search = SEARCHES["never"]
    ids, mask = sources(TINY.vocab_size, seed=3)
    eos = 6  # a token the random model emits early in some beams and late in others
    model = PrefixLM(dataclasses.replace(TINY, eos_token_id=eos), rngs=nnx.Rngs(0))
    out = beam_search(model, ids, mask, max_new_tokens=12, search=search, pad_id=PAD)
    k = search.num_beams

    def log_probs(prefixes: list[list[int]]) -> np.ndarray:
        rows = np.arange(len(prefixes)) // k
        outputs = np.array([prefix[1:] for prefix in prefixes], np.int64)
        logits = full_logits(model, ids[rows], mask[rows], outputs)
        return np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))

    expected, scores = python_beam_search(log_probs, len(ids), search, eos, eos, PAD)
    np.testing.assert_array_equal(out.sequences, expected)
    np.testing.assert_allclose(out.scores, scores, rtol=1e-5, atol=1e-5)
    assert len(ends(expected, eos)) >= 3  # hypotheses finished at different steps


# ------------------------------------------------------------------------------ masking
def authors_masking(source_length: int, target_length: int, settings: MaskedTargetSettings,
                    rand: random.Random) -> tuple[set[int], list[str]]:
    """unilm-v1 `Preprocess4Seq2seq.__call__`'s masking re-stated (seq2seq_loader.py 183-249;
    no n-gram spans, no whole words): positions in [CLS] a [SEP] b [SEP] and what each
    became ("mask", "random" or "kept")."""
    length_a, length_b = source_length, target_length
    effective = length_b + (length_a if settings.mask_source_words else 0)
    n_pred = min(settings.max_pred, max(1, int(round(effective * settings.mask_prob))))
    source = list(range(1, length_a + 1)) if settings.mask_source_words else []  # a
    candidates = source + list(range(length_a + 2, length_a + length_b + 3))  # b, [SEP]
    rand.shuffle(candidates)
    chosen = set(candidates[:n_pred])
    kinds = []
    for _ in chosen:
        if rand.random() < 0.8:
            kinds.append("mask")
        elif rand.random() < 0.5:
            kinds.append("random")
        else:
            kinds.append("kept")
    return chosen, kinds


@pytest.mark.parametrize("mask_source_words", [False, True])
def test_masking_follows_the_authors_loader(mask_source_words):
    """Over 1,000 draws for each of four (document, summary) lengths: the count masked per
    example is exactly unilm-v1's (Python's half-to-even rounding, the max_pred cap); the
    source is masked only with `mask_source_words` and never at its EOS; every candidate
    position is chosen as often as in the authors' loader (within 5 standard errors), and
    [MASK] / a random id / the token kept as often (80/10/10); only the chosen tokens change;
    the packed positions index the masked tokens."""
    settings = MaskedTargetSettings(mask_prob=0.7, max_pred=6,
                                    mask_source_words=mask_source_words)
    lengths = [(3, 1), (4, 5), (2, 9), (5, 6)]  # (document tokens, summary tokens)
    rows = 1000
    width, length = 6, 10
    inputs = np.zeros((rows * 4, width), np.int32)
    targets = np.zeros((rows * 4, length), np.int32)
    rng = np.random.default_rng(0)
    for i, (a, b) in enumerate(np.repeat(lengths, rows, axis=0)):
        inputs[i, :a + 1] = [*rng.integers(5, 40, a), EOS]
        targets[i, :b + 1] = [*rng.integers(5, 40, b), EOS]
    batch = {"inputs": jnp.asarray(inputs), "input_mask": jnp.asarray(inputs != 0),
             "targets": jnp.asarray(targets), "target_mask": jnp.asarray(targets != 0)}
    masks = sample_masks(jax.random.key(1), batch, settings, vocab_size=40, mask_id=MASK,
                         eos_id=EOS)
    weights, positions = np.asarray(masks.weights) > 0, np.asarray(masks.positions)
    packed = np.concatenate([np.full((len(inputs), 1), SOS), inputs, targets], axis=1)
    labels = np.take_along_axis(packed, positions, axis=1)
    np.testing.assert_array_equal(np.asarray(masks.labels)[weights], labels[weights])
    after = np.concatenate([np.asarray(masks.inputs), np.asarray(masks.targets)], axis=1)
    chosen = np.zeros_like(after, bool)
    np.put_along_axis(chosen, positions - 1, weights, axis=1)
    assert not ((after != np.concatenate([inputs, targets], axis=1)) & ~chosen).any()

    rand, kinds = random.Random(0), []
    for case, (a, b) in enumerate(lengths):
        ours = np.zeros(a + b + 3)
        for row_weights, row_positions in zip(weights[case * rows:(case + 1) * rows],
                                              positions[case * rows:(case + 1) * rows],
                                              strict=True):
            # ours: [SOS] at 0, the source block (width wide), then the target block
            packed_positions = row_positions[row_weights]
            in_source = packed_positions <= width
            theirs = np.where(in_source, packed_positions,
                              packed_positions - (width + 1) + a + 2)
            np.add.at(ours, theirs, 1)
        authors = np.zeros(a + b + 3)
        counts = set()
        for _ in range(rows):
            picked, became = authors_masking(a, b, settings, rand)
            np.add.at(authors, list(picked), 1)
            counts.add(len(picked))
            kinds += became
        assert counts == {int(row.sum()) for row in weights[case * rows:(case + 1) * rows]}
        if not mask_source_words:
            assert ours[:a + 2].sum() == 0 and authors[:a + 2].sum() == 0
        assert ours[0] == ours[a + 1] == 0  # never [CLS] / the source's EOS
        p = authors / rows
        bound = 5 * np.sqrt(np.maximum(p * (1 - p), 1e-4) / rows) * rows
        np.testing.assert_array_less(np.abs(ours - authors), bound + 1, err_msg=str((a, b)))
    # a random id may be [MASK] or the token itself (1 / V each)
    theirs = {kind: kinds.count(kind) / len(kinds) for kind in ("mask", "random")}
    became = np.take_along_axis(after, positions - 1, axis=1)[weights]
    assert np.mean(became == MASK) == pytest.approx(theirs["mask"] + theirs["random"] / 40,
                                                    abs=0.02)
    assert np.mean((became != MASK) & (became != labels[weights])) == pytest.approx(
        theirs["random"] * 38 / 40, abs=0.015)
    # Python's round: 5 x 0.7 = 3.5 -> 4, 1 x 0.7 -> 1; the cap: 9 x 0.7 -> 6
    expected = {(3, 1): 1, (4, 5): 4, (2, 9): 6, (5, 6): 4} if not mask_source_words else {
        (3, 1): 3, (4, 5): 6, (2, 9): 6, (5, 6): 6}
    for case, key in enumerate(lengths):
        assert set(weights[case * rows:(case + 1) * rows].sum(1)) == {expected[key]}, key
    with pytest.raises(UserError, match=r"objective.mask_prob=0 must be in \(0, 1\]"):
        MaskedTargetSettings(mask_prob=0)


def test_smoothed_loss_equals_the_authors_label_smoothing_loss():
    """`smoothed_kl` against unilm-v1's `LabelSmoothingLoss` (loss.py) re-stated in torch:
    eps / (V - 2) on every id but the label and padding (id 0), the KL divergence; with eps 0
    the plain NLL; the fairseq-style smoothing differs (negative control)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 4, 11)).astype(np.float32)
    labels = rng.integers(1, 11, (3, 4))
    log_probs = torch.log_softmax(torch.tensor(logits), -1)
    eps, vocab = 0.1, 11
    target = torch.full((12, vocab), eps / (vocab - 2))
    target[:, 0] = 0
    target.scatter_(1, torch.tensor(labels).reshape(-1, 1), 1 - eps)
    theirs = torch.nn.functional.kl_div(log_probs.reshape(-1, vocab), target,
                                        reduction="none").sum(1).reshape(3, 4).numpy()
    ours, nll = smoothed_kl(jnp.asarray(log_probs.numpy()), jnp.asarray(labels), eps, PAD)
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-5, atol=1e-6)
    plain = -np.take_along_axis(log_probs.numpy(), labels[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(smoothed_kl(jnp.asarray(log_probs.numpy()),
                                                      jnp.asarray(labels), 0.0, PAD)[0]),
                               plain, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(nll), plain, rtol=1e-6)
    fairseq = (1 - eps) * plain - eps * log_probs.numpy().mean(-1)
    assert np.abs(fairseq - theirs).max() > 1e-2


# ------------------------------------------------------------------------------ the CLI
@pytest.fixture(scope="module")
def unilm_dir(toy, tmp_path_factory):  # noqa: F811
    """A random BERT with UniLM's six token types saved as a `unilm` model directory with the
    toy corpus's tokenizer."""
    folder = tmp_path_factory.mktemp("unilm") / "model"
    tokenizer = toy["tokenizer"]
    model = Bert(UnilmConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_layers=2,
                             num_heads=2, intermediate_size=64, type_vocab_size=6,
                             max_position_embeddings=48), rngs=nnx.Rngs(0))
    save_model(model, "unilm", folder)
    directories.write_tokenizer(folder, tokenizer)
    return str(folder)


SHORT = ["train.steps=8", "train.eval_every=4", "train.checkpoint_every=4",
         "examples.rouge_examples=6", "train.progress=false"]
TINY_RECIPE = "unilm_summarize_tiny"


def test_cli_from_a_unilm_model_trains_decodes_and_resumes(toy, unilm_dir, tmp_path,  # noqa: F811
                                                           capsys):
    """`run.py finetune --task summarize --init <unilm model>`: UniLM's recipe (the masked
    target, beam 5, trigram ban, 30 epochs at 10 % warmup), and with `--recipe
    unilm_summarize_tiny` (the test size: 40 + 12 tokens, 3 beams, no dropout) for 8 steps, which
    lower the held-out loss and print the dev ROUGE beside lead-3, which results.json holds:
    rouge-score's on the final model's beam search summaries decoded here; the BERT's weights
    start the run, its 48 position rows tiled to 64; 4 steps, a restart and 4 more equal the 8
    straight ones; refusals are one line."""
    data, workdir = str(toy["root"]), tmp_path / "run"
    config = finetune_config("summarize", unilm_dir, data, SHORT, recipe=TINY_RECIPE)
    recipe = finetune_config("summarize", unilm_dir, data)
    assert (recipe.method, recipe.objective.mask_prob, recipe.objective.label_smoothing,
            recipe.examples.num_beams, recipe.examples.no_repeat_ngram_size,
            recipe.model.max_position_embeddings) == ("summarize_unilm", 0.7, 0.1, 5, 3, 768)
    assert recipe.train.steps == 30 * -(-300 // 48)
    assert recipe.optim.warmup_steps == round(0.1 * recipe.train.steps)
    assert run.main(["finetune", "--task", "summarize", "--init", unilm_dir, "--data", data,
                     "--workdir", str(workdir), "--recipe", TINY_RECIPE, *SHORT]) == 0
    out = capsys.readouterr().out
    line = out[out.index("summarize dev after"):].splitlines()[0]
    assert LINE.match(line) and line.startswith("summarize dev after 8 steps"), line
    rows = [json.loads(r) for r in (workdir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r["split"] == "eval"]
    assert len(losses) == 2 and losses[1] < losses[0], losses

    # results.json's ROUGE: the final model's beam search summaries of the dev documents.
    texts = assert_results_rouge(workdir, data, toy["tokenizer"], config.examples.search, 6)
    assert any(texts), texts  # not vacuous: the summaries have words

    bert = loading.load_model(unilm_dir)
    fresh = ed.pretrained_start(config.model, 0, loading.load_pretrained,
                                family=ed.FAMILIES["unilm"])
    table = np.asarray(bert.encoder.embeddings.position_embeddings.embedding[...])
    np.testing.assert_array_equal(
        np.asarray(fresh.encoder.embeddings.position_embeddings.embedding[...]),
        np.concatenate([table, table[:16]]))
    np.testing.assert_array_equal(np.asarray(fresh.lm_head.bias[...]),
                                  np.asarray(bert.lm_head.bias[...]))

    assert Trainer(config, tmp_path / "resumed").run(stop_after=4)["step"] == 4
    resumed = Trainer(config, tmp_path / "resumed").run()["state"].params
    straight = loading.load_model(workdir)
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(straight, nnx.Param)),
                                 nnx.to_flat_state(nnx.state(resumed)), strict=True):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()),
                                      err_msg=str(path))

    with pytest.raises(UserError, match="the model has 768 positions but .* reach 770"):
        finetune_config("summarize", unilm_dir, data, ["examples.max_source_length=568"])
    bert_dir = tmp_path / "bert"
    save_model(Bert(EncoderConfig(vocab_size=toy["tokenizer"].vocab_size, hidden_size=32,
                                  num_layers=2, num_heads=2, intermediate_size=64),
                    rngs=nnx.Rngs(0)), "bert", bert_dir)
    directories.write_tokenizer(bert_dir, toy["tokenizer"])
    with pytest.raises(UserError, match="model.type_vocab_size=2 has no token type 5") as error:
        finetune_config("summarize", str(bert_dir), data)
    assert "\n" not in str(error.value)
