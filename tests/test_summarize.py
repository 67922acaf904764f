"""Summarisation (`run.py finetune --task summarize`, objectives/summarization.py): ROUGE against
hand counts and rouge-score, the lead-3 baseline's sentences, one-line refusals of malformed
files, the summary decoding's beam search (n-gram ban, minimum and maximum length, length
penalty, early stopping) token for token against HF `generate` on converted T5 and ProphetNet
weights, the label-smoothed loss (ProphetNet: every stream), the recipes each starting point
gets, and a run on synthetic documents whose summary is their last sentence: it trains, decodes
with beams, beats lead-3 and resumes exactly."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity_utils import random_model
from test_beam_search import NEW_TOKENS, converted  # noqa: F401 (a fixture)

from pretext_jax import run
from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import summaries
from pretext_jax.input_pipeline.tokenizers import SentencePieceTokenizer
from pretext_jax.models.beam_search import beam_search
from pretext_jax.models.prophetnet import ProphetNet, ProphetNetConfig
from pretext_jax.models.t5 import T5, T5Config
from pretext_jax.models.xlm import XLM, XLMConfig
from pretext_jax.objectives import summarization
from pretext_jax.objectives.common import encoder_decoders as ed
from pretext_jax.objectives.common.losses import label_smoothed_cross_entropy
from pretext_jax.objectives.prophetnet import ProphetNetLossSettings, ngram_loss
from pretext_jax.objectives.summarization import SummaryExampleConfig, rouge
from pretext_jax.pretrain import directories, loading
from pretext_jax.pretrain.export import save_model
from pretext_jax.pretrain.finetune import finetune_config
from pretext_jax.pretrain.trainer import Trainer

rouge_scorer = pytest.importorskip("rouge_score.rouge_scorer")


# ------------------------------------------------------------------------------ ROUGE
def test_rouge_equals_hand_counts_and_rouge_score():
    """F1 x 100 from counts made by hand; ROUGE-Lsum's union LCS over sentences against one LCS
    over the text; stemming; the mean over documents; an unrelated summary scores 0."""
    scores = rouge(["the cat on the mat"], ["the cat sat on the mat"])
    # unigrams: 5 of 5 predicted, 5 of 6 reference; bigrams: 3 of 4 and 3 of 5; LCS 5
    assert scores["rouge1"] == pytest.approx(100 * 10 / 11)
    assert scores["rouge2"] == pytest.approx(100 * 2 * (3 / 4) * (3 / 5) / (3 / 4 + 3 / 5))
    assert scores["rougeL"] == scores["rougeLsum"] == pytest.approx(100 * 10 / 11)
    swapped = rouge(["d e f. a b c."], ["a b c. d e f."])
    assert swapped["rougeL"] == pytest.approx(50.0)  # LCS of the texts: 3 of 6
    assert swapped["rougeLsum"] == pytest.approx(100.0)  # each sentence's LCS: all 6
    assert rouge(["cats running"], ["cat run"])["rouge1"] == pytest.approx(100.0)
    assert rouge(["cats running"], ["cat run"], stemmer=False)["rouge1"] == 0.0
    assert rouge(["red green blue"], ["one two three"]) == dict.fromkeys(
        summarization.ROUGE_TYPES, 0.0)  # negative control
    pairs = [("the cat on the mat", "the cat sat on the mat"), ("a b. c d.", "c d. a x.")]
    mean = rouge([p for p, _ in pairs], [r for _, r in pairs])
    scorer = rouge_scorer.RougeScorer(list(summarization.ROUGE_TYPES), use_stemmer=True)
    for name in summarization.ROUGE_TYPES:
        direct = [scorer.score(r.replace(". ", ".\n"), p.replace(". ", ".\n"))[name].fmeasure
                  for p, r in pairs]
        assert mean[name] == pytest.approx(100 * np.mean(direct)), name


def test_sentences_and_lead3():
    text = 'It rained. "Stay in!" he said. Why? Then (at noon) it stopped.\nNew line here'
    assert summaries.sentences(text) == ["It rained.", '"Stay in!"', "he said.", "Why?",
                                         "Then (at noon) it stopped.", "New line here"]
    assert summaries.lead(text) == 'It rained. "Stay in!" he said.'
    assert summaries.lead("One sentence only") == "One sentence only"


# ------------------------------------------------------------------------------ files
def test_malformed_files_are_one_line_errors(tmp_path):
    def refused(match, **files):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        for name, text in files.items():
            (folder / name.replace("_", ".")).write_text(text)
        with pytest.raises(UserError, match=match) as error:
            summaries.check_files(summaries.split_files(folder, "train"))
        assert "\n" not in str(error.value)

    refused(r"train.source has 3 lines but train.target has 2; line i of the target",
            train_source="a\nb\nc\n", train_target="x\ny\n")
    refused(r"train.tsv line 2 has no tab; each line must be document<TAB>summary",
            train_tsv="doc\tsum\nno tab here\n")
    refused(r"train.tsv line 1 has 3 tab-separated columns", train_tsv="a\tb\tc\n")
    refused(r"train.src is empty", train_src="", train_tgt="")
    refused(r"has train.source but no train.target", train_source="a\n")
    refused(r"no train files in .*train.source \+ train.target, train.src \+ train.tgt, "
            r"train.tsv", dev_tsv="a\tb\n")
    folder = tmp_path / "ok"
    folder.mkdir()
    (folder / "valid.tsv").write_text("doc one.\tsum one\n\t\n  \tx\ndoc two\tsum two\n")
    files = summaries.split_files(folder, "dev")  # dev's other names
    assert list(summaries.read_pairs(files)) == [("doc one.", "sum one"), ("doc two", "sum two")]


# ------------------------------------------------------------------------------ decoding
SETTINGS = {  # the papers' kinds of setting: trigram ban, minimum length, fairseq's early stop
    "fairseq": dict(num_beams=4, length_penalty=1.5, no_repeat_ngram_size=3, min_length=6,
                    early_stopping=True),
    "hf": dict(num_beams=4, length_penalty=0.8, no_repeat_ngram_size=2, min_length=3,
               early_stopping=False),
}


@pytest.mark.usefixtures("deterministic_torch")
@pytest.mark.parametrize("family", ["t5", "prophetnet"])
def test_summary_decoding_equals_hf_generate(converted, family):  # noqa: F811
    """The dev decoding (`ed.decode_rows` with `SummaryExampleConfig.search`, batches padded
    to DECODE_BATCH) gives HF `generate(num_beams=4, no_repeat_ngram_size=..., min_length=...,
    length_penalty=..., early_stopping=..., max_new_tokens=max_length)`'s best summaries token
    for token; without the settings the outputs differ (they act)."""
    import torch

    reference, model, eos = converted[family]
    rng = np.random.default_rng(1)
    mask = (np.arange(9) < np.array([9, 6, 3, 7, 8])[:, None]).astype(np.int64)
    ids = rng.integers(3, 61, mask.shape) * mask
    records = {"inputs": ids, "input_mask": mask}
    for name, settings in SETTINGS.items():
        examples = SummaryExampleConfig(max_length=NEW_TOKENS, **settings)
        ours = ed.decode_rows(model, records, len(ids), examples.search,
                              examples.decoded_length, ed.FAMILIES[family], pad_id=0)
        with torch.no_grad():
            out = reference.generate(input_ids=torch.tensor(ids),
                                     attention_mask=torch.tensor(mask), do_sample=False,
                                     max_new_tokens=NEW_TOKENS, eos_token_id=eos,
                                     pad_token_id=0, **settings).numpy()[:, 1:]
        expected = [row[:list(row).index(eos)].tolist() if eos in row else row.tolist()
                    for row in out]
        assert ours == expected, name
        plain = ed.decode_rows(model, records, len(ids),
                               dataclasses.replace(examples, min_length=0,
                                                   no_repeat_ngram_size=0).search,
                               NEW_TOKENS, ed.FAMILIES[family], pad_id=0)
        assert plain != ours, name
        assert min(len(row) + 1 for row in ours) >= settings["min_length"]


def test_label_smoothed_losses():
    """T5: (1 - eps) NLL + eps x the mean of -log p over the vocabulary, per target token;
    ProphetNet: that over every predicting stream, equal to its pre-training's n-gram loss
    (checked against HF there) with every stream on every target."""
    rng = np.random.default_rng(0)
    logits, labels = rng.normal(size=(2, 5, 11)), rng.integers(0, 11, (2, 5))
    weights = (np.arange(5) < np.array([[5], [2]])).astype(np.float32)
    loss, metrics = label_smoothed_cross_entropy(jnp.asarray(logits), jnp.asarray(labels),
                                                 jnp.asarray(weights), 0.1, epsilon=0.0)
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_p, labels[..., None], -1)[..., 0]
    expected = (0.9 * nll - 0.1 * log_p.mean(-1)) * weights
    assert float(loss) == pytest.approx(expected.sum() / weights.sum(), rel=1e-5)
    assert float(metrics["nll"][0]) == pytest.approx((nll * weights).sum(), rel=1e-5)

    model = random_model(ProphetNet, ProphetNetConfig(
        vocab_size=30, hidden_size=16, num_encoder_layers=1, num_decoder_layers=1,
        num_encoder_attention_heads=2, num_decoder_attention_heads=2, encoder_ffn_dim=24,
        decoder_ffn_dim=24, max_position_embeddings=20, num_buckets=8, relative_max_distance=6,
        eos_token_id=2), 0)
    targets = jnp.asarray(rng.integers(3, 30, (2, 6)) * (np.arange(6) < np.array([[6], [4]])))
    batch = {"inputs": jnp.asarray(rng.integers(3, 30, (2, 7))), "input_mask": jnp.ones((2, 7)),
             "targets": targets, "target_mask": (targets != 0).astype(jnp.int32),
             "source_language_ids": jnp.zeros((2, 7), jnp.int32),
             "target_language_ids": jnp.zeros((2, 6), jnp.int32)}
    family = ed.FAMILIES["prophetnet"]
    ours, _ = ed.teacher_forced_loss(model, batch, None, family=family, label_smoothing=0.1,
                                     all_streams=True)
    start = jnp.full((2, 1), model.config.decoder_start_token_id, targets.dtype)
    out = model(batch["inputs"], batch["input_mask"],
                jnp.concatenate([start, targets[:, :-1]], axis=1))
    reference, _ = ngram_loss(out.ngram_logits, targets, ProphetNetLossSettings(
        label_smoothing=0.1, streams_within_span=False))
    assert float(ours) == pytest.approx(float(reference), rel=1e-5)
    next_token, _ = ed.teacher_forced_loss(model, batch, None, family=family,
                                           label_smoothing=0.1)
    plain, _ = ed.teacher_forced_loss(model, batch, None, family=family, all_streams=True)
    # negative controls, far beyond the float32 agreement above
    assert abs(float(next_token) - float(ours)) > 1e-4  # stream 0 only
    assert abs(float(plain) - float(ours)) > 1e-4  # no smoothing


# ------------------------------------------------------------------------------ runs
ANIMALS, VERBS, THINGS = ("cat", "dog", "fox", "owl"), ("saw", "chased", "found", "ate"), (
    "ball", "fish", "box", "hat")
FILLER = ("It was late.", "The sky was grey.", "Nobody noticed.", "Then it rained.",
          "Birds sang loudly.", "A car passed by.")


def write_split(root, split: str, count: int, seed: int) -> list[str]:
    """`count` documents of three filler sentences then "The A V the T.", whose summary is
    "The A V a T." (lead-3 misses it), as split.source / split.target; their text."""
    rng = np.random.default_rng(seed)
    documents, summaries_ = [], []
    for _ in range(count):
        a, v, t = (words[rng.integers(len(words))] for words in (ANIMALS, VERBS, THINGS))
        filler = [FILLER[i] for i in rng.permutation(len(FILLER))[:3]]
        documents.append(" ".join([*filler, f"The {a} {v} the {t}."]))
        summaries_.append(f"The {a} {v} a {t}.")
    (root / f"{split}.source").write_text("".join(d + "\n" for d in documents))
    (root / f"{split}.target").write_text("".join(s + "\n" for s in summaries_))
    return documents + summaries_


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """The synthetic corpus, its sentencepiece tokenizer, and a random T5 saved as a `mass`
    model directory with it."""
    root = tmp_path_factory.mktemp("summaries")
    text = write_split(root, "train", 300, 0) + write_split(root, "dev", 24, 1)
    tokenizer = SentencePieceTokenizer.train(text, root / "spm", vocab_size=45)
    model = T5(T5Config(vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_id,
                        hidden_size=32, num_layers=1, num_heads=2, head_size=16,
                        intermediate_size=64, feed_forward_proj="gelu"), rngs=nnx.Rngs(0))
    save_model(model, "mass", root / "mass")
    directories.write_tokenizer(root / "mass", tokenizer)
    return {"root": root, "tokenizer": tokenizer, "init": str(root / "mass")}


FAST = ["train.batch_size=16", "optim.learning_rate=0.02", "optim.warmup_steps=10",
        "examples.max_source_length=40", "examples.max_target_length=12",
        "examples.min_length=0", "examples.max_length=12", "examples.num_beams=3",
        "model.hidden_dropout=0", "model.attention_dropout=0", "train.progress=false"]
LINE = re.compile(r"summarize dev after (\d+) steps: " + ", ".join(
    rf"{name} ([0-9.]+) \(lead-3 ([0-9.]+)\)" for name in summarization.ROUGE_TYPES) + "$")


def assert_results_rouge(workdir, data: str, tokenizer, search, count: int | None = None
                         ) -> list[str]:
    """results.json's ROUGE is rouge-score's on the beam search summaries (`search`, FAST's 40 /
    12 tokens) of the first `count` dev documents (None: all) by the workdir's final model,
    decoded here; returns those summaries."""
    model = loading.load_model(workdir)
    pairs = list(summaries.encoded_pairs(summaries.split_files(data, "dev"), tokenizer))[:count]
    records = [summaries.summary_record(d, s, 0, 40, 12, tokenizer.eos_id, tokenizer.pad_id)
               for _, _, d, s in pairs]
    decoded = beam_search(
        model, np.stack([r["inputs"] for r in records]),
        np.stack([r["input_mask"] for r in records]), max_new_tokens=12, search=search,
        pad_id=tokenizer.pad_id).sequences[:, 0]
    texts = [tokenizer.decode(row[:list(row).index(tokenizer.eos_id)].tolist()
                              if tokenizer.eos_id in row else row.tolist()) for row in decoded]
    result = json.loads((Path(workdir) / "results.json").read_text())
    expected = rouge(texts, [s for _, s, _, _ in pairs])
    for name in summarization.ROUGE_TYPES:
        assert result["dev"][name] == pytest.approx(expected[name], abs=1e-9), name
    return texts


def test_cli_summarize_trains_decodes_beats_lead3_and_resumes(toy, tmp_path, capsys):
    """From a MASS model directory: MASS's recipe with the test's overrides; two epochs lower
    the held-out loss and beat lead-3 (which misses the last sentence); results.json's ROUGE is
    rouge-score's on the final model's beam search summaries decoded here; `run.py eval` prints
    the same line; 4 steps, a restart, 4 more equal 8 straight ones; a malformed file is a
    one-line error before anything is written."""
    workdir, data = tmp_path / "run", str(toy["root"])
    assert run.main(["finetune", "--task", "summarise", "--init", toy["init"], "--data", data,
                     "--workdir", str(workdir), "--epochs", "2", *FAST]) == 0
    out = capsys.readouterr().out
    line = out[out.index("summarize dev after"):].strip()
    match = LINE.match(line)
    assert match, line
    values = [float(v) for v in match.groups()[1:]]
    ours, lead3 = dict(zip(summarization.ROUGE_TYPES, values[::2], strict=True)), dict(
        zip(summarization.ROUGE_TYPES, values[1::2], strict=True))
    assert ours["rougeLsum"] > lead3["rougeLsum"] + 20, line
    assert "lead-3 baseline" not in out  # not at the baseline
    rows = [json.loads(r) for r in (workdir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r["split"] == "eval"]
    assert losses[-1] < losses[0] - 0.3, losses
    config = finetune_config("summarize", toy["init"], data, FAST, epochs=2)
    assert config.method == "summarize" and config.objective.label_smoothing == 0.1
    assert (config.examples.no_repeat_ngram_size, config.optim.b2) == (3, 0.98)  # MASS's

    assert_results_rouge(workdir, data, toy["tokenizer"], config.examples.search)
    assert run.main(["eval", "--workdir", str(workdir)]) == 0
    assert capsys.readouterr().out.strip() == re.sub(r"after (\d+) steps", r"at step \1", line)

    # Exact resume: 4 steps, a restart, 4 more == 8 straight steps.
    short = finetune_config("summarize", toy["init"], data, [*FAST, "train.steps=8",
                                                             "train.checkpoint_every=4",
                                                             "train.eval_every=8"])
    straight = Trainer(short, tmp_path / "straight").run()["state"].params
    assert Trainer(short, tmp_path / "resumed").run(stop_after=4)["step"] == 4
    resumed = Trainer(short, tmp_path / "resumed").run()["state"].params
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(straight)),
                                 nnx.to_flat_state(nnx.state(resumed)), strict=True):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()),
                                      err_msg=str(path))

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "train.source").write_text("a.\nb.\n")
    (bad / "train.target").write_text("x\n")
    (bad / "dev.tsv").write_text("a\tb\n")
    assert run.main(["finetune", "--task", "summarize", "--init", toy["init"], "--data",
                     str(bad), "--workdir", str(tmp_path / "bad_run"), *FAST]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "train.source has 2 lines but train.target has 1" in err
    assert not (tmp_path / "bad_run").exists()


def test_each_starting_point_gets_its_papers_recipe(toy, tmp_path):
    """MASS (model.json's method), T5 (prefix, Adafactor), BART (a T5 run with text infilling),
    ProphetNet (its method, 10 epochs) and XLM (MASS's recipe on XLM's encoder-decoder);
    BART's counts updates unless --epochs is given."""
    data, tokenizer = str(toy["root"]), toy["tokenizer"]
    mass = finetune_config("summarize", toy["init"], data)
    assert (mass.method, mass.optim.learning_rate, mass.examples.num_beams,
            mass.examples.min_length, mass.optim.warmup_steps) == ("summarize", 5e-4, 5, 51, 4000)
    assert mass.train.steps == 25 * -(-300 // 64)  # 25 epochs of the 300 pairs
    t5_dir = tmp_path / "t5"
    save_model(loading.load_model(toy["init"]), "t5", t5_dir)
    directories.write_tokenizer(t5_dir, tokenizer)
    t5 = finetune_config("summarize", str(t5_dir), data)
    assert (t5.examples.source_prefix, t5.optim.optimizer, t5.train.steps) == (
        "summarize: ", "adafactor", 262144)
    model = loading.load_model(toy["init"])
    assert summarization.recipe_preset(model, {"method": "t5", "examples": {
        "noise": "text_infilling"}}) == "bart_summarize"
    prophetnet_dir, xlm_dir = tmp_path / "prophetnet", tmp_path / "xlm"
    save_model(ProphetNet(ProphetNetConfig(
        vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_id, hidden_size=16,
        num_encoder_layers=1, num_decoder_layers=1, num_encoder_attention_heads=2,
        num_decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
        max_position_embeddings=64), rngs=nnx.Rngs(0)), "prophetnet", prophetnet_dir)
    save_model(XLM(XLMConfig(vocab_size=tokenizer.vocab_size, n_langs=1, hidden_size=16,
                             num_layers=1, num_heads=2, intermediate_size=64,
                             pad_token_id=tokenizer.pad_id), rngs=nnx.Rngs(0)), "xlm", xlm_dir)
    for folder in (prophetnet_dir, xlm_dir):
        directories.write_tokenizer(folder, tokenizer)
    with pytest.raises(UserError, match="the model has 62 positions but .* reach 510"):
        finetune_config("summarize", str(prophetnet_dir), data)  # the recipe's 510 tokens
    prophetnet = finetune_config("summarize", str(prophetnet_dir), data, [
        "examples.max_source_length=40", "examples.max_target_length=40",
        "examples.max_length=60"])
    assert (prophetnet.method, prophetnet.examples.length_penalty,
            prophetnet.train.steps) == ("summarize_prophetnet", 1.2, 10 * -(-300 // 512))
    xlm = finetune_config("summarize", str(xlm_dir), data)
    assert (xlm.method, xlm.optim.learning_rate) == ("summarize_xlm", 5e-4)
    with pytest.raises(UserError, match="examples.language_id=1 but the model has 1 language"):
        finetune_config("summarize", str(xlm_dir), data, ["examples.language_id=1"])
    with pytest.raises(UserError, match="examples.min_length=30 exceeds the decoded length 12"):
        SummaryExampleConfig(min_length=30, max_length=12)
    with pytest.raises(UserError, match="num_beams=0 must be >= 1"):
        SummaryExampleConfig(num_beams=0)


def test_summary_records_and_the_prefix(toy):
    tokenizer = toy["tokenizer"]
    record = summaries.summary_record(list(range(3, 50)), [7, 8], 2, 10, 6, tokenizer.eos_id,
                                      tokenizer.pad_id)
    assert record["inputs"].tolist() == [*range(3, 12), tokenizer.eos_id]  # cut, then EOS
    assert record["targets"].tolist()[:3] == [7, 8, tokenizer.eos_id]
    assert record["target_mask"].tolist() == [1, 1, 1, 0, 0, 0]
    assert (record["source_language_ids"] == 2).all()
    files = summaries.split_files(toy["root"], "dev")
    plain = next(summaries.encoded_pairs(files, tokenizer))
    prefixed = next(summaries.encoded_pairs(files, tokenizer, "summarize: "))
    assert prefixed[2][-len(plain[2]):] == plain[2] and len(prefixed[2]) > len(plain[2])
