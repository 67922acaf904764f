"""MASS (input_pipeline/examples/mass.py, objectives/mass.py) against the paper's definition
(Song et al. 2019 §2.2, §3.1) and microsoft/MASS's sampling: the fragment's length k =
round(0.5 m), contiguity and start distribution; 80/10/10 inside the fragment only; the decoder
reading the fragment shifted right with everything else masked; loss only on the fragment; the
edge cases k = 1 (BERT's masked LM) and k = m (a standard LM) built and checked on the model;
mass_tiny from the CLI with falling held-out loss, one step equal on every mesh, and a killed
run that resumes bit for bit; the bilingual setting: segments tagged with their language, one
language per batch in turn, and mass_bilingual_tiny from the CLI with language embeddings;
mass_xlm_tiny (the reference's model and layout, tests/test_mass_xlm.py) from the CLI."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from resilience_utils import (
    GRADIENT_STEP,
    abort_and_resume,
    assert_same_step_on_every_mesh,
    assert_same_training,
    mesh_overrides,
    run_in_process,
    small_corpus,
)

from pretext_jax import run
from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import mass as me
from pretext_jax.input_pipeline.examples.bert import MaskingVocab
from pretext_jax.models.t5 import T5, T5Config
from pretext_jax.models.xlm import XLMTranslation
from pretext_jax.objectives import mass
from pretext_jax.objectives.common.losses import weighted_cross_entropy
from pretext_jax.objectives.mass import mass_loss
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.loading import load_model
from pretext_jax.pretrain.trainer import Trainer

VOCAB = MaskingVocab(vocab_size=500, pad_id=0, cls_id=2, sep_id=3, mask_id=4,
                     continuation=np.zeros(500, bool))
SPECIALS = 5  # ids below this are special: corpus tokens are drawn from 5 up


def segment(length: int, rng: np.random.Generator, pad_to: int = 64) -> np.ndarray:
    """A record's tokens: `length - 1` corpus tokens and EOS, padded with 0."""
    tokens = np.zeros(pad_to, np.int32)
    tokens[:length - 1] = rng.integers(SPECIALS, VOCAB.vocab_size, length - 1)
    tokens[length - 1] = VOCAB.sep_id
    return tokens


def fragment_of(example: dict[str, np.ndarray]) -> np.ndarray:
    """The positions the loss is on (non-zero targets)."""
    return np.flatnonzero(example["targets"])


def draw(config: me.MassExampleConfig, tokens: np.ndarray, rng: np.random.Generator):
    return me.MassMasking(VOCAB, config).random_map({"tokens": tokens}, rng)


def test_fragment_is_half_the_segment_contiguous_and_predicted_exactly():
    """For every length m the loss positions are k = round(0.5 (m + 1)) consecutive positions
    (m + 1: the reference's sentence-start </s> counted, `fragment_counts_sentence_start`); the
    targets are the segment's tokens there; the decoder reads the token before each (the start
    token 0 at position 0) and [MASK] at every other position of the segment."""
    rng = np.random.default_rng(0)
    config = me.MassExampleConfig(max_seq_length=64)
    for length in range(2, 65):
        assert config.fragment_size(length) == min(length, round((length + 1) / 2))
        tokens = segment(length, rng)
        for _ in range(5):
            example = draw(config, tokens, rng)
            positions = fragment_of(example)
            k, u = config.fragment_size(length), positions[0]
            assert len(positions) == k and np.array_equal(positions, np.arange(u, u + k))
            np.testing.assert_array_equal(example["targets"][positions], tokens[positions])
            previous = np.concatenate([[0], tokens[:-1]])
            expected = np.where(np.arange(64) < length, VOCAB.mask_id, 0)
            expected[positions] = previous[positions]
            np.testing.assert_array_equal(example["decoder_inputs"], expected)
            np.testing.assert_array_equal(example["input_mask"], np.arange(64) < length)
            outside = np.setdiff1d(np.arange(64), positions)
            np.testing.assert_array_equal(example["inputs"][outside], tokens[outside])
    # Python's round halves to even, as the reference: m + 1 = 5 -> 2, 7 -> 4, 9 -> 4; k is
    # capped at m.
    assert [config.fragment_size(m) for m in (1, 2, 4, 6, 8)] == [1, 2, 2, 4, 4]
    assert me.MassExampleConfig(fragment_length=6).fragment_size(4) == 4


@pytest.mark.parametrize("at_start, at_end", [(0.2, 0.2), (0.0, 0.0)])
def test_start_distribution(at_start, at_end):
    """u = 0 with probability at_start, m - k with at_end, else uniform over 0 .. m - k (the
    reference's 20/20/60); with both 0, uniform."""
    rng = np.random.default_rng(1)
    config = me.MassExampleConfig(fragment_at_start_prob=at_start, fragment_at_end_prob=at_end)
    length, draws = 21, 40000
    size = config.fragment_size(length)  # 11 = round(0.5 x 22)
    slots = length - size + 1
    starts = np.array([me.fragment_start(length, size, config, rng) for _ in range(draws)])
    expected = np.full(slots, (1 - at_start - at_end) / slots)
    expected[0] += at_start
    expected[-1] += at_end
    observed = np.bincount(starts, minlength=slots) / draws
    assert observed.shape == expected.shape
    np.testing.assert_allclose(observed, expected, atol=4 * np.sqrt(0.25 / draws))
    assert me.fragment_start(7, 7, config, rng) == 0  # k = m: the only start


def test_encoder_replacement_is_80_10_10_inside_the_fragment_only():
    rng = np.random.default_rng(2)
    config = me.MassExampleConfig(max_seq_length=64)
    counts, total = np.zeros(3), 0
    for _ in range(3000):
        tokens = segment(int(rng.integers(6, 65)), rng)
        example = draw(config, tokens, rng)
        positions = fragment_of(example)
        inputs, original = example["inputs"][positions], tokens[positions]
        masked = inputs == VOCAB.mask_id
        kept = ~masked & (inputs == original)
        counts += masked.sum(), kept.sum(), (~masked & ~kept).sum()
        total += len(positions)
        outside = np.setdiff1d(np.arange(64), positions)
        np.testing.assert_array_equal(example["inputs"][outside], tokens[outside])
    # A random token equal to the original counts as kept: 0.1 + 0.1 / 500 of the fragment.
    expected = np.array([0.8, 0.1 + 0.1 / 500, 0.1 - 0.1 / 500])
    np.testing.assert_allclose(counts / total, expected, atol=0.006)


def pure(fragment_length: int = 0) -> me.MassExampleConfig:
    """Every fragment token becomes [MASK] (no random or kept tokens), to read the edge cases
    exactly as the paper's Figure 2 draws them."""
    return me.MassExampleConfig(fragment_length=fragment_length, mask_token_prob=1.0,
                                random_token_prob=0.0)


def test_k_equal_1_is_bert_and_k_equal_m_is_a_standard_lm():
    """k = 1: one [MASK] in the encoder input, one target, and no fragment token reaches the
    decoder (its only non-[MASK] input is the start token or the token before, which the
    encoder sees). k = m: the encoder input is all [MASK], the decoder reads the sentence
    shifted right from the start token and predicts every token: a left-to-right LM."""
    rng = np.random.default_rng(3)
    for length in (2, 9, 30):
        tokens = segment(length, rng)
        example = draw(pure(fragment_length=1), tokens, rng)
        (u,) = fragment_of(example)
        assert (example["inputs"][:length] == VOCAB.mask_id).sum() == 1
        assert example["inputs"][u] == VOCAB.mask_id
        visible = example["decoder_inputs"][:length] != VOCAB.mask_id
        assert np.flatnonzero(visible).tolist() == [u]
        assert example["decoder_inputs"][u] == (0 if u == 0 else example["inputs"][u - 1])

        example = draw(pure(fragment_length=length), tokens, rng)
        assert fragment_of(example).tolist() == list(range(length))
        assert (example["inputs"][:length] == VOCAB.mask_id).all()
        assert example["decoder_inputs"][:length].tolist() == [0, *tokens[:length - 1]]
        np.testing.assert_array_equal(example["targets"], tokens)
    # The fraction 1.0 gives the same LM construction.
    assert me.MassExampleConfig(fragment_fraction=1.0).fragment_size(17) == 17


@pytest.fixture(scope="module")
def tiny_t5():
    config = T5Config(vocab_size=VOCAB.vocab_size, hidden_size=32, num_layers=2, num_heads=2,
                      head_size=16, intermediate_size=64, hidden_dropout=0.0,
                      attention_dropout=0.0)
    return T5(config, rngs=nnx.Rngs(0))


def batch_of(examples: list[dict[str, np.ndarray]]) -> dict[str, jnp.ndarray]:
    return {key: jnp.asarray(np.stack([e[key] for e in examples])) for key in examples[0]}


def test_edge_cases_on_the_model(tiny_t5):
    """On the network. k = m is a left-to-right LM: the encoder input is the same all-[MASK]
    row whatever the sentence, and the prediction at position j changes only when tokens
    before j change. k = 1: the loss is on one token."""
    rng = np.random.default_rng(4)
    tokens = segment(12, rng, pad_to=16)
    lm = draw(pure(fragment_length=12), tokens, rng)
    changed = tokens.copy()
    changed[8:11] = (changed[8:11] + 1 - SPECIALS) % (VOCAB.vocab_size - SPECIALS) + SPECIALS
    lm_changed = draw(pure(fragment_length=12), changed, rng)
    assert (lm["inputs"] == lm_changed["inputs"]).all()  # the encoder sees no token
    logits = tiny_t5(*(jnp.asarray(np.stack([a[k] for a in (lm, lm_changed)]))
                       for k in ("inputs", "input_mask", "decoder_inputs"))).logits
    np.testing.assert_allclose(logits[0, :9], logits[1, :9], atol=1e-6)  # causal: j <= 8
    assert np.abs(np.asarray(logits[0, 9:12] - logits[1, 9:12])).max() > 1e-4
    # k = 1: the loss is one token, a function of the encoder's view only.
    bert = draw(pure(fragment_length=1), tokens, rng)
    loss, metrics = mass_loss(tiny_t5, batch_of([bert]), None)
    assert float(metrics["target_tokens"][0]) == 1.0 and np.isfinite(float(loss))


def test_loss_is_cross_entropy_on_the_fragment_only(tiny_t5):
    """The loss equals a numpy cross-entropy of the logits at the fragment positions, and
    changing targets outside the fragment to 0 changes nothing."""
    rng = np.random.default_rng(5)
    config = me.MassExampleConfig(max_seq_length=16)
    examples = [draw(config, segment(int(n), rng, pad_to=16), rng) for n in (16, 9, 5)]
    batch = batch_of(examples)
    loss, metrics = mass_loss(tiny_t5, batch, None)
    logits = np.asarray(tiny_t5(batch["inputs"], batch["input_mask"], batch["decoder_inputs"],
                                cross_attention_mask=batch["cross_attention_mask"]).logits,
                        np.float64)
    targets = np.asarray(batch["targets"])
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
    weights = targets != 0
    assert weights.sum() == sum(config.fragment_size(n) for n in (16, 9, 5))
    np.testing.assert_allclose(float(loss), nll[weights].sum() / (weights.sum() + 1e-6),
                               rtol=1e-5)
    assert float(metrics["target_tokens"][0]) == weights.sum()
    assert float(metrics["input_tokens"][0]) == 16 + 9 + 5


def test_decoder_attends_to_the_unmasked_encoder_positions_only(tiny_t5):
    """`cross_attention_mask` is the segment's positions whose encoder input is not [MASK]
    (MASS `mass_step`: enc_mask = x1 != mask_index): the fragment's random and kept tokens stay
    visible. The loss uses it: the decoder's logits do not change when the encoder's output at
    the [MASK]ed positions does, and they differ from a decoder that sees every position."""
    rng = np.random.default_rng(11)
    config = me.MassExampleConfig(max_seq_length=16)
    examples = [draw(config, segment(int(n), rng, pad_to=16), rng) for n in (16, 11)] * 40
    for example in examples:
        expected = (example["input_mask"] == 1) & (example["inputs"] != VOCAB.mask_id)
        np.testing.assert_array_equal(example["cross_attention_mask"], expected)
    # Over many draws, some fragment tokens are random or kept and stay visible (80/10/10).
    visible_in_fragment = sum(int(e["cross_attention_mask"][fragment_of(e)].sum())
                              for e in examples)
    assert 0 < visible_in_fragment < sum(len(fragment_of(e)) for e in examples) * 0.4
    batch = batch_of(examples[:2])
    encoded = tiny_t5.encode(batch["inputs"], batch["input_mask"])
    noise = jnp.where(batch["cross_attention_mask"][..., None] == 0,
                      jax.random.normal(jax.random.key(0), encoded.shape), 0.0)
    decoded, noisy, unmasked = (
        tiny_t5.decode(batch["decoder_inputs"], states, mask)
        for states, mask in ((encoded, batch["cross_attention_mask"]),
                             (encoded + noise, batch["cross_attention_mask"]),
                             (encoded, batch["input_mask"])))
    np.testing.assert_allclose(decoded, noisy, atol=1e-5)
    assert np.abs(np.asarray(decoded - unmasked)).max() > 1e-3
    loss, _ = mass_loss(tiny_t5, batch, None)
    with_mask = tiny_t5(batch["inputs"], batch["input_mask"], batch["decoder_inputs"],
                        cross_attention_mask=batch["cross_attention_mask"])
    targets = batch["targets"]
    reference, _ = weighted_cross_entropy(with_mask.logits, targets,
                                          (targets != 0).astype(jnp.float32), epsilon=1e-6)
    np.testing.assert_allclose(float(loss), float(reference), rtol=1e-6)


def test_segments_and_settings():
    documents = [[list(range(5, 8)), list(range(10, 30)), list(range(40, 46))]]
    config = me.MassExampleConfig(max_seq_length=8, min_length=4)
    records = [r["tokens"] for r in me.create_training_examples(documents, config, 3)]
    # 3 tokens < min_length: dropped; 20 -> 7 + 7 + 6 (+ EOS each); 6 -> one segment.
    lengths = [int(np.count_nonzero(r)) for r in records]
    assert lengths == [8, 8, 7, 7] and all(r[n - 1] == 3 for r, n in zip(records, lengths,
                                                                         strict=True))
    assert records[0][:7].tolist() == list(range(10, 17))
    # drop_long_sentences (the reference's --max_len): the 20-token sentence is left out.
    dropping = dataclasses.replace(config, drop_long_sentences=True)
    assert [int(np.count_nonzero(r["tokens"])) for r in
            me.create_training_examples(documents, dropping, 3)] == [7]
    for bad in ({"fragment_fraction": 0.0}, {"fragment_length": -1}, {"min_length": 100},
                {"fragment_at_start_prob": 0.7, "fragment_at_end_prob": 0.4},
                {"mask_token_prob": 0.95, "random_token_prob": 0.1}, {"max_seq_length": 1}):
        with pytest.raises(UserError, match="examples."):
            me.MassExampleConfig(**bad)


# --- Training through the Trainer -----------------------------------------------------------

SHORT = {"model.hidden_size": 32, "model.num_heads": 2, "model.intermediate_size": 64,
         "examples.max_seq_length": 24, "data.vocab_size": 60, "train.batch_size": 16,
         "train.steps": 8, "train.log_every": 1, "train.eval_every": 1000,
         "train.eval_batches": 1, "train.checkpoint_every": 3, "train.progress": False}


def test_same_step_on_every_mesh(tmp_path):
    """One plain gradient step gives the same loss and parameters on one device and on the
    (2, 2, 2) mesh; the step moves the parameters."""
    data = small_corpus(tmp_path)

    def trainer_at(workdir, mesh, devices):
        return Trainer(make_config("mass_tiny", {**SHORT, **data, **GRADIENT_STEP,
                                                 **mesh_overrides(mesh)}), workdir,
                       devices=devices)

    batch = assert_same_step_on_every_mesh(trainer_at, tmp_path)
    assert (np.asarray(batch["targets"]) != 0).sum() > 50


def test_killed_run_resumes_bit_for_bit(tmp_path):
    """Killed in place of step 5 (`abort_and_resume`: the step-3 checkpoint is the last),
    then a rerun: the same batches
    (masks drawn per record while loading), losses and final parameters as an uninterrupted
    run."""
    overrides = {**SHORT, **small_corpus(tmp_path)}
    reference = tmp_path / "reference", tmp_path / "reference.log"
    run_in_process("mass_tiny", overrides, *reference)
    ours = abort_and_resume("mass_tiny", overrides, tmp_path, step=5)
    assert len(assert_same_training("mass_tiny", overrides, ours, reference)) > 8


def test_cli_trains_mass_tiny_with_falling_held_out_loss(tmp_path):
    """`run.py pretrain --preset mass_tiny --data FILE`: the held-out loss falls between the
    first and the last evaluation, to well below the uniform guess."""
    data = small_corpus(tmp_path)
    workdir = tmp_path / "run"
    settings = [f"{key}={value}" for key, value in {**SHORT, **data}.items()
                if key not in ("data.source", "train.steps", "train.eval_every",
                               "train.log_every")]
    assert run.main(["pretrain", "--preset", "mass_tiny", "--data", data["data.source"],
                     "--workdir", str(workdir), *settings, "train.steps=40",
                     "train.eval_every=20", "train.log_every=10"]) == 0
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    evaluations = [row["loss"] for row in rows if row["split"] == "eval"]
    assert len(evaluations) == 2 and evaluations[-1] < evaluations[0] - 0.5, evaluations
    assert evaluations[-1] < np.log(60) - 1.0, evaluations


def bilingual_corpus(root) -> dict[str, str]:
    """English and German template text (not aligned), 40 documents of 8 sentences each; the
    data settings that read them as one bilingual corpus."""
    templates = {"en": "Sentence {i} talks about topic {t} and then some more words.",
                 "de": "Satz {i} spricht über Thema {t} und dann noch mehr Wörter hier."}
    for language, template in templates.items():
        sentences = [template.format(i=i, t=i % 7) for i in range(320)]
        (root / f"mono.{language}").write_text("\n\n".join(
            "\n".join(sentences[i:i + 8]) for i in range(0, 320, 8)) + "\n", encoding="utf-8")
    return {"data.source": f"en={root / 'mono.en'},de={root / 'mono.de'}",
            "data.cache_dir": str(root / "cache")}


BILINGUAL = {**SHORT, "data.vocab_size": 80, "train.batch_size": 8,
             "data.held_out_fraction": 0.1}


def test_bilingual_segments_carry_their_language_and_a_step_reads_one_language(tmp_path):
    """Each language's segments hold its id (sorted order: de 0, en 1) on every encoder and
    decoder position; every step's batch is of one language, the languages drawn uniformly
    (MASS-unsupNMT's shuf_order of --mass_steps); held-out text of both languages; the data
    sets the model's language count."""
    config = make_config("mass_bilingual_tiny", {**BILINGUAL, **bilingual_corpus(tmp_path)})
    prepared = mass.prepare_mass(config.data, config.examples, tmp_path / "cache", 0)
    by_eight = dataclasses.replace(config, train=dataclasses.replace(config.train, batch_size=8))
    assert prepared.model_fields["num_languages"] == 2 and prepared.segments is not None
    steps = prepared.segment(1, by_eight).records(None)
    assert steps.names == ("de", "en")
    words = {0: {"Satz", "spricht", "über", "Thema", "und", "dann", "noch", "mehr", "Wörter"},
             1: {"Sentence", "talks", "about", "topic", "and", "then", "some", "more", "words"}}
    masking = prepared.transforms[0]
    rng = np.random.default_rng(0)
    languages = [steps.step_set(step) for step in range(40)]
    assert 12 <= sum(languages) <= 28, languages  # uniform over the two languages
    for step in range(6):
        language = languages[step]
        records = [steps.records[0].spec.decode(steps[step * 8 + row]) for row in range(8)]
        assert {int(r["language"][0]) for r in records} == {language}
        for record in records:
            text = prepared.tokenizer.decode([int(t) for t in record["tokens"][:-1] if t])
            found = set(text.replace(".", " ").split())
            assert found & words[language] and not found & words[1 - language], text
            example = masking.random_map(record, rng)
            assert (example["language_ids"] == language).all()
    # A step's draw depends on its number only, so a restart reads the same batches.
    assert steps.choose(19) == prepared.segment(1, by_eight).records(None).choose(19)
    assert set(np.unique(prepared.eval["language_ids"])) == {0, 1}


def test_cli_trains_mass_bilingual_tiny_with_language_embeddings(tmp_path):
    """`run.py pretrain --preset mass_bilingual_tiny --data en=...,de=...`: the model gets two
    language embeddings and the held-out loss of both languages falls."""
    data = bilingual_corpus(tmp_path)
    workdir = tmp_path / "run"
    settings = [f"{key}={value}" for key, value in {**BILINGUAL, **data}.items()
                if key not in ("data.source", "train.steps", "train.eval_every",
                               "train.log_every")]
    assert run.main(["pretrain", "--preset", "mass_bilingual_tiny", "--data",
                     data["data.source"], "--workdir", str(workdir), *settings,
                     "train.steps=40", "train.eval_every=20", "train.log_every=10"]) == 0
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    evaluations = [row["loss"] for row in rows if row["split"] == "eval"]
    assert len(evaluations) == 2 and evaluations[-1] < evaluations[0] - 0.5, evaluations
    model = load_model(workdir)
    assert model.config.num_languages == 2 and model.language_embeddings is not None


def test_a_fragment_in_every_block_of_packed_segments():
    """ProphetNet's inputs (§4.1): a document's sentences packed into segments of
    max_seq_length, with one 15 % span in every 64-token block. Each block holds exactly one
    run of round(0.15 x its length) masked positions inside it; the last, shorter block gets
    its own; without blocks a segment has one fragment (MASS)."""
    rng = np.random.default_rng(3)
    config = me.MassExampleConfig(max_seq_length=200, min_length=5, fragment_fraction=0.15,
                                  fragment_at_start_prob=0.0, fragment_at_end_prob=0.0,
                                  fragment_block=64, pack_sentences=True)
    document = [list(range(10 + i, 10 + i + n)) for i, n in enumerate([50, 70, 90, 40])]
    pieces = list(me.segments([document], config, eos_id=3))
    stream = np.concatenate([np.append(s, 3) for s in document])
    assert [len(p) for p in pieces] == [200, 54] and np.array_equal(np.concatenate(pieces),
                                                                    stream)
    for _ in range(50):
        tokens = np.zeros(256, np.int32)
        tokens[:200] = pieces[0]
        example = draw(config, tokens, rng)
        positions = fragment_of(example)
        for first, size in ((0, 10), (64, 10), (128, 10), (192, 1)):  # 8 tokens: round(1.2)
            inside = positions[(positions >= first) & (positions < first + 64)]
            assert len(inside) == size and np.array_equal(inside, inside[0] + np.arange(size))
        previous = np.concatenate([[0], tokens[:-1]])
        np.testing.assert_array_equal(example["decoder_inputs"][positions], previous[positions])
    single = dataclasses.replace(config, fragment_block=0)
    positions = fragment_of(draw(single, tokens, rng))
    assert len(positions) == 30 and np.array_equal(positions, positions[0] + np.arange(30))


def test_cli_trains_mass_xlm_tiny_on_the_reference_model(tmp_path):
    """`run.py pretrain --preset mass_xlm_tiny --data en=...,de=...`: XLM's encoder-decoder with
    two language embeddings and a cross-attention output per language, on the reference's
    layout (a step reads one language); the held-out loss falls, below the uniform guess."""
    data = bilingual_corpus(tmp_path)
    workdir = tmp_path / "run"
    settings = [f"{key}={value}" for key, value in {**BILINGUAL, **data}.items()
                if key not in ("data.source", "train.steps", "train.eval_every",
                               "train.log_every")]
    assert run.main(["pretrain", "--preset", "mass_xlm_tiny", "--data", data["data.source"],
                     "--workdir", str(workdir), *settings, "model.intermediate_size=128",
                     "train.steps=40", "train.eval_every=20", "train.log_every=10"]) == 0
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    evaluations = [row["loss"] for row in rows if row["split"] == "eval"]
    assert len(evaluations) == 2 and evaluations[-1] < evaluations[0] - 0.3, evaluations
    assert evaluations[-1] < np.log(80) - 0.5, evaluations  # below the uniform guess
    model = load_model(workdir)
    assert type(model) is XLMTranslation and model.config.n_langs == 2
    assert model.decoder.layers.cross_output.kernel.shape == (2, 32, 64)  # [L, H, 2 H]
