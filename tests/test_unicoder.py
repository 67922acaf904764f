"""Unicoder (objectives/unicoder.py, Huang et al. 2019 §3): the records of the five tasks against
a re-statement of their construction (cross-lingual documents whose even-index sentences are
translations, TLM and paraphrase pairs, word-recovery pairs), the samplers' rates over many
draws, every loss term against a numpy re-statement (word recovery's attention over the
translation's embeddings included), one sharded step equal to the single-device step, an
exact in-process resume, and the one-line refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from resilience_utils import (
    GRADIENT_STEP,
    abort_and_resume,
    assert_same_step_on_every_mesh,
    assert_same_training,
    final_params,
    flat_params,
    mesh_overrides,
    run_in_process,
)
from text_utils import sentences
from xlm_numpy import flat, numpy_xlm

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import unicoder as examples
from pretext_jax.objectives.unicoder import unicoder_loss
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.trainer import Trainer

TINY = {"model.hidden_size": 16, "model.num_layers": 1, "model.num_heads": 2,
        "model.intermediate_size": 64, "model.max_position_embeddings": 48,
        "model.embed_init_std": 16 ** -0.5, "examples.stream_length": 48,
        "examples.max_sentence_length": 12, "examples.max_predictions_per_seq": 8,
        "data.vocab_size": 40, "train.batch_size": 16, "train.log_every": 1,
        "train.eval_batches": 1, "train.eval_every": 1000, "train.progress": False,
        "optim.warmup_steps": 2}


@pytest.fixture(scope="module")
def settings(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("unicoder")
    for split, count in (("train", 300), ("valid", 40)):
        pairs = sentences(count, seed=count)
        for index, language in enumerate(("en", "de")):
            (root / f"{split}.{language}").write_text("".join(p[index] + "\n" for p in pairs))
    return {**TINY, "data.source": f"{root / 'train.en'},{root / 'train.de'}",
            "data.eval_source": f"{root / 'valid.en'},{root / 'valid.de'}",
            "data.cache_dir": str(root / "cache")}


@pytest.fixture(scope="module")
def trainer(settings, tmp_path_factory) -> Trainer:
    return Trainer(make_config("unicoder_tiny", {**settings, "train.steps": 4}),
                   tmp_path_factory.mktemp("run"))


def restated_document(lines, start, languages, ids, length, eos):
    """(tokens, langs) of `</s> s_0 </s> s_1 </s> ...`: sentence k in languages[k % n], whole
    sentences while they fit (§3.3's cross-lingual document with n = 2)."""
    tokens, langs = [eos], [ids[languages[0]]]
    for k in range(start, len(lines)):
        language = languages[(k - start) % len(languages)]
        if len(tokens) + len(lines[k][language]) + 1 > length:
            break
        tokens += lines[k][language] + [eos]
        langs += [ids[language]] * (len(lines[k][language]) + 1)
    return tokens, langs


def real(record, group):
    mask = record[f"{group}_input_mask"] > 0
    return (record[f"{group}_input_ids"][mask].tolist(), record[f"{group}_langs"][mask].tolist(),
            record[f"{group}_positions"][mask].tolist())


def test_records_restate_the_five_tasks_and_the_samplers_rates(trainer, settings):
    """Every training record against its construction from the tokenized lines; then the
    samplers' rates over 6,000 draws: base language and paraphrase negatives 1/2 each (within
    4 sigma), negatives never the line itself, a document's translated share of sentences."""
    config, tokenizer = trainer.config.examples, trainer.data.tokenizer
    eos = tokenizer.eos_id
    ids = {"de": 0, "en": 1}
    lines = examples.tokenized_lines(settings["data.source"], tokenizer, config, None)
    records = trainer.data.train.examples(range(len(trainer.data.train)))
    order = trainer.data.train.written_order()
    assert len(lines) == len(records["pc_label"]) > 150  # long pairs dropped
    corpus = {language: {tuple(line[language]) for line in lines} for language in ids}
    for i in range(len(lines)):
        record = {k: v[order[i]] for k, v in records.items()}
        base, other = ("de", "en") if record["wr_langs"][0] == 0 else ("en", "de")
        assert record["wr_langs"].tolist() == [ids[base], ids[other]]
        source = record["wr_source"][record["wr_source_mask"] > 0].tolist()
        target = record["wr_target"][record["wr_target_mask"] > 0].tolist()
        assert (source, target) == (lines[i][base], lines[i][other])
        for group, languages in (("mlm", [base]), ("xmlm", [base, other])):
            tokens, langs = restated_document(lines, i, languages, ids, 48, eos)
            assert real(record, group) == (tokens, langs, list(range(len(tokens))))
        halves = [[eos, *lines[i][base], eos], [eos, *lines[i][other], eos]]
        assert real(record, "tlm") == (
            halves[0] + halves[1], [ids[base]] * len(halves[0]) + [ids[other]] * len(halves[1]),
            list(range(len(halves[0]))) + list(range(len(halves[1]))))
        pc_ids, pc_langs, _ = real(record, "pc")
        second = pc_ids[len(halves[0]) + 1:-1]
        assert pc_ids[:len(halves[0])] == halves[0]
        # A positive is the line's translation, a negative another line's.
        assert (second == lines[i][other]) == (record["pc_label"][0] == 1)
        assert tuple(second) in corpus[other] and pc_langs[-1] == ids[other]
    # The samplers over many draws (token ids stand in for sentences).
    rng = np.random.default_rng(0)
    many = [{"en": rng.integers(5, 40, rng.integers(1, 6)).tolist(),
             "de": [100 + t for t in rng.integers(5, 40, rng.integers(1, 6))]}
            for _ in range(6000)]
    eos, pad = 2, 1
    drawn = list(examples.unicoder_examples(many, ["de", "en"], ids, config, eos, pad, seed=3))
    sigma = 4 * math.sqrt(0.25 / len(drawn))
    labels = np.array([r["pc_label"][0] for r in drawn])
    assert abs((labels == 0).mean() - 0.5) < sigma
    assert abs(np.mean([r["wr_langs"][0] == 1 for r in drawn]) - 0.5) < sigma
    translated = total = 0
    for i, r in enumerate(drawn[:500]):
        base, other = ("en", "de") if r["wr_langs"][0] == 1 else ("de", "en")
        pc_second = r["pc_input_ids"][r["pc_input_mask"] > 0].tolist()[len(many[i][base]) + 3:-1]
        assert (pc_second == many[i][other]) == (r["pc_label"][0] == 1)
        langs = r["xmlm_langs"][r["xmlm_input_mask"] > 0]
        ends = np.flatnonzero(r["xmlm_input_ids"][r["xmlm_input_mask"] > 0] == eos)[1:]
        sentence_langs = langs[ends]
        expected = np.resize([ids[base], ids[other]], len(sentence_langs))
        np.testing.assert_array_equal(sentence_langs, expected)
        translated += int((sentence_langs != ids[base]).sum())
        total += len(sentence_langs)
    assert abs(translated / total - 0.5) < 0.05


def numpy_ce(logits, labels, weights, epsilon=1e-5):
    logits = logits - logits.max(-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_probs, labels[..., None], -1)[..., 0]
    return float((weights * nll).sum() / (weights.sum() + epsilon))


def test_each_loss_term_against_numpy(trainer):
    """MLM, TLM, cross-lingual MLM, word recovery (A_ij = W [x_i; y_j; x_i * y_j], softmax
    over the translation's words, X^t = A Y through the encoder, every source word predicted)
    and paraphrase classification (first token, two classes) on a real batch, against numpy;
    the total is their sum."""
    full = {k: np.asarray(v) for k, v in next(trainer.data_iterator()).items()}
    labels = full["pc_label"][:, 0]
    rows = np.concatenate([np.flatnonzero(labels == 0)[:3], np.flatnonzero(labels == 1)[:3]])
    batch = {k: v[rows] for k, v in full.items()}  # both classes; few rows for numpy's speed
    model = trainer.method.build_model(trainer.model_config, 0)
    config = trainer.model_config

    total, metrics = nnx.jit(lambda m, b: unicoder_loss(m, b, None))(model, batch)
    terms = {name: float(metrics[f"{name}_loss"][0] / metrics[f"{name}_loss"][1])
             for name in ("mlm", "tlm", "xmlm", "wr", "pc")}
    params = flat(model.transformer)
    table = params[("word_embeddings", "embedding")].astype(np.float64)
    bias = params[("output_bias",)].astype(np.float64)
    for group in examples.MASKED:
        _, logits = numpy_xlm(params, config, batch[f"{group}_input_ids"],
                              batch[f"{group}_langs"], batch[f"{group}_input_mask"],
                              causal=False, positions=batch[f"{group}_positions"])
        picked = np.take_along_axis(logits, batch[f"{group}_masked_lm_positions"][..., None], 1)
        expected = numpy_ce(picked, batch[f"{group}_masked_lm_ids"],
                            batch[f"{group}_masked_lm_weights"])
        np.testing.assert_allclose(terms[group], expected, rtol=2e-5, err_msg=group)
    # Word recovery.
    w = np.asarray(model.recovery_weight[...], np.float64)
    x, y = table[batch["wr_source"]], table[batch["wr_target"]]
    scores = ((x @ w[0])[:, :, None] + (y @ w[1])[:, None, :]
              + np.einsum("bsh,bth->bst", x * w[2], y))
    scores = np.where(batch["wr_target_mask"][:, None, :] > 0, scores, -np.inf)
    attention = np.exp(scores - scores.max(-1, keepdims=True))
    attention /= attention.sum(-1, keepdims=True)
    mixed = attention @ y * batch["wr_source_mask"][..., None]
    rows, length = batch["wr_source"].shape
    # numpy_xlm reads token embeddings from the table: one row of X^t per (row, position).
    fake = {**params, ("word_embeddings", "embedding"): mixed.reshape(rows * length, -1),
            ("output_bias",): np.zeros(rows * length)}
    langs = np.repeat(batch["wr_langs"][:, :1], length, 1)
    hidden, _ = numpy_xlm(fake, config, np.arange(rows * length).reshape(rows, length), langs,
                          batch["wr_source_mask"], causal=False)
    expected = numpy_ce(hidden @ table.T + bias, batch["wr_source"], batch["wr_source_mask"])
    np.testing.assert_allclose(terms["wr"], expected, rtol=2e-5)
    _, jax_attention = model.recovery_inputs(batch["wr_source"], batch["wr_source_mask"],
                                             batch["wr_target"], batch["wr_target_mask"])
    np.testing.assert_allclose(np.asarray(jax_attention), attention, atol=1e-6)
    # Paraphrase classification.
    hidden, _ = numpy_xlm(params, config, batch["pc_input_ids"], batch["pc_langs"],
                          batch["pc_input_mask"], causal=False, positions=batch["pc_positions"])
    head = {k[-1]: np.asarray(v[...], np.float64) for k, v in
            nnx.to_flat_state(nnx.state(model.paraphrase, nnx.Param))}
    logits = hidden[:, 0] @ head["kernel"] + head["bias"]
    labels = batch["pc_label"][:, 0]
    np.testing.assert_allclose(terms["pc"],
                               numpy_ce(logits, labels, np.ones(len(labels)), 0.0), rtol=2e-5)
    # The total (training moves W and the classifier: the resume test).
    np.testing.assert_allclose(float(total), sum(terms.values()), rtol=1e-5)
    assert set(metrics) >= {f"{t}_accuracy" for t in ("mlm", "tlm", "xmlm", "wr", "pc")}


def test_sharded_step_equals_single_device_and_resume_is_exact(settings, tmp_path):
    """One (2,2,2)-mesh step equals the single-device step; then a run on that mesh with the
    same step (so the compiled program is reused), stopped in place of step 4 after the
    step-2 checkpoint and resumed in process, repeats the uninterrupted run bit for bit."""
    mixed = {**settings, **GRADIENT_STEP, "optim.learning_rate": 0.5, "train.steps": 2}
    assert_same_step_on_every_mesh(
        lambda workdir, mesh, devices: Trainer(make_config("unicoder_tiny", {
            **mixed, **mesh_overrides(mesh)}), workdir, devices=devices), tmp_path / "mesh")
    overrides = {**mixed, **mesh_overrides((2, 2, 2)), "train.steps": 5,
                 "train.checkpoint_every": 2}
    reference = tmp_path / "reference", tmp_path / "reference.log"
    run_in_process("unicoder_tiny", overrides, *reference)
    ours = abort_and_resume("unicoder_tiny", overrides, tmp_path, step=4)
    executed = assert_same_training("unicoder_tiny", overrides, ours, reference)
    assert len(executed) > 5  # step 3 was lost with the kill and redone
    # The gradient reaches the word-recovery weight W and the paraphrase layer.
    trainer = Trainer(make_config("unicoder_tiny", overrides), tmp_path / "fresh")
    start = flat_params(trainer.init_state().params)
    trained = final_params("unicoder_tiny", overrides, ours[0])
    for part in ("recovery_weight", "paraphrase"):
        keys = [key for key in start if part in key]
        assert keys and all(np.abs(trained[k] - start[k]).max() > 1e-4 for k in keys), part


def test_refusals(settings, tmp_path):
    """Monolingual or three-language data, a causal model, positions too few, a rate out of
    range: each a one-line UserError naming the fix."""
    root = tmp_path
    for language in ("en", "de", "fr"):
        (root / f"a.{language}").write_text("one\n")
    three = ",".join(str(root / f"a.{language}") for language in ("en", "de", "fr"))
    for bad, match in (({"data.source": str(root / "a.en")}, "parallel corpus"),
                       ({"data.source": three, "data.eval_source": ""}, "two languages"),
                       ({"model.causal": True}, "bidirectional"),
                       ({"model.max_position_embeddings": 32}, "stream_length"),
                       ({"examples.paraphrase_negative_rate": 1.5}, "negative_rate")):
        with pytest.raises(UserError, match=match):
            Trainer(make_config("unicoder_tiny", {**settings, **bad}), root / "w").data  # noqa: B018


def test_starts_from_an_hf_xlm_checkpoint(settings, tmp_path):
    """§4: from an HF XLM folder (`model.init` and `data.tokenizer` the folder): the
    Transformer starts with the checkpoint's weights, W and the paraphrase layer at random;
    the records hold XLM's Moses + BPE ids and the checkpoint's language ids (its table puts en
    at 1 and de at 2, where the sorted order would give de 0). Without the checkpoint's
    tokenizer it is a one-line refusal naming data.tokenizer. (Training from there is the
    step every other test runs.)"""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("sacremoses")
    torch = pytest.importorskip("torch")
    from text_utils import write_xlm_tokenizer

    from pretext_jax.pretrain.loading import load_pretrained

    lines = [line for path in settings["data.source"].split(",")
             for line in Path(path).read_text().splitlines()]
    folder = write_xlm_tokenizer(tmp_path / "xlm", lines, True, 60, {"fr": 0, "en": 1, "de": 2})
    vocab_size = len(json.loads((folder / "vocab.json").read_text()))
    torch.manual_seed(0)
    transformers.XLMWithLMHeadModel(transformers.XLMConfig(
        vocab_size=vocab_size, emb_dim=16, n_layers=1, n_heads=2, n_langs=3,
        max_position_embeddings=48, embed_init_std=16 ** -0.5, init_std=0.02, dropout=0.0,
        attention_dropout=0.0, pad_index=2, pad_token_id=2, lang2id={"fr": 0, "en": 1, "de": 2},
    )).save_pretrained(str(folder))
    start = {**settings, "model.init": str(folder), "data.tokenizer": str(folder),
             "train.steps": 1}
    trainer = Trainer(make_config("unicoder_tiny", start), tmp_path / "w")
    assert trainer.model_config.n_langs == 3 and trainer.model_config.vocab_size == vocab_size
    records = trainer.data.train.examples(range(len(trainer.data.train)))
    assert set(np.unique(records["wr_langs"]).tolist()) == {1, 2}
    # The records' sentences are XLM's ids of each language (HF `XLMTokenizer` the oracle).
    hf = transformers.XLMTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"))
    raw = dict(zip(("en", "de"), (Path(p).read_text().splitlines()
                                  for p in settings["data.source"].split(",")), strict=True))
    expected = [{lang: hf.convert_tokens_to_ids(hf._tokenize(raw[lang][i], lang=lang))
                 for lang in raw} for i in range(len(raw["en"]))]
    expected = [line for line in expected if all(0 < len(t) <= 12 for t in line.values())]
    assert examples.tokenized_lines(settings["data.source"], trainer.data.tokenizer,
                                    trainer.config.examples, None) == expected
    sources = {tuple(line[lang]) for line in expected for lang in line}
    assert all(tuple(row[mask > 0]) in sources
               for row, mask in zip(records["wr_source"], records["wr_source_mask"], strict=True))
    params = flat_params(trainer.init_state().params)
    checkpoint = flat_params(nnx.state(load_pretrained(folder), nnx.Param))
    transformer = {key.removeprefix("['transformer']"): value for key, value in params.items()
                   if key.startswith("['transformer']")}
    assert transformer.keys() == checkpoint.keys() and len(checkpoint) > 10
    assert all(np.array_equal(transformer[key], checkpoint[key]) for key in checkpoint)
    random = Trainer(make_config("unicoder_tiny", {**start, "model.init": ""}), tmp_path / "r")
    fresh = flat_params(random.init_state().params)
    assert all(np.array_equal(fresh[key], params[key]) for key in params
               if not key.startswith("['transformer']"))  # W and the classifier: the seed's
    assert not any(np.array_equal(fresh[key], params[key]) for key in params
                   if key.startswith("['transformer']") and params[key].std() > 0)
    with pytest.raises(UserError, match="pass data.tokenizer="):
        Trainer(make_config("unicoder_tiny", {**start, "data.tokenizer": ""}),
                tmp_path / "bad").init_state()


def test_starts_from_a_pretext_xlm_run(settings, tmp_path):
    """A pretext XLM run (TLM on the same parallel corpus) as `model.init`, its recorded
    tokenizer as `data.tokenizer`: the Transformer starts with the run's trained weights, the
    language ids in the sorted order both runs use."""
    from pretext_jax.pretrain.loading import load_model

    xlm = tmp_path / "xlm"
    xlm_settings = {key: value for key, value in settings.items()
                    if not key.startswith("examples.")}
    Trainer(make_config("xlm_tiny", {**xlm_settings, "examples.task": "tlm",
                                     "examples.max_sentence_length": 12,
                                     "examples.stream_length": 48, "train.steps": 1}),
            xlm).run()
    start = {**settings, "model.init": str(xlm), "data.tokenizer": str(xlm / "tokenizer")}
    trainer = Trainer(make_config("unicoder_tiny", start), tmp_path / "w")
    assert trainer.model_config.n_langs == 2
    params = flat_params(trainer.init_state().params)
    trained = flat_params(nnx.state(load_model(xlm), nnx.Param))
    assert all(np.array_equal(params["['transformer']" + key], value)
               for key, value in trained.items())
