"""Translation: T5's language embeddings (MASS's bilingual setting), greedy encoder-decoder
decoding (`models.beam_search.greedy_seq2seq`) against HF `generate`, and the `translation`
fine-tune with its BLEU check, greedy or by beam search (`objectives.translation`)."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity_utils import hf_reference, random_model

from pretext_jax import run
from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import translation as te
from pretext_jax.input_pipeline.tokenizers import SentencePieceTokenizer
from pretext_jax.models.beam_search import BeamSearch, beam_search, greedy_seq2seq
from pretext_jax.models.hf import t5 as t5_hf
from pretext_jax.models.prophetnet import ProphetNet, ProphetNetConfig
from pretext_jax.models.t5 import T5, T5Config
from pretext_jax.models.xlm import XLM, XLMConfig, XLMTranslation, XLMTranslationConfig
from pretext_jax.objectives import translation
from pretext_jax.objectives.common import encoder_decoders
from pretext_jax.objectives.common.encoder_decoders import T5TranslationConfig
from pretext_jax.objectives.registry import PreparedData
from pretext_jax.pretrain import directories, hf, loading, translate
from pretext_jax.pretrain.config import config_from_dict, make_config
from pretext_jax.pretrain.export import save_model
from pretext_jax.pretrain.trainer import Trainer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
sacrebleu = pytest.importorskip("sacrebleu")

HF_T5 = dict(vocab_size=61, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
             num_heads=4, feed_forward_proj="relu", tie_word_embeddings=True,
             decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
SMALL = T5Config(vocab_size=40, hidden_size=16, num_layers=1, num_heads=2, head_size=8,
                 intermediate_size=24, hidden_dropout=0.0, attention_dropout=0.0)


def sources(vocab_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """[4, 9] source ids padded at the end of three rows, and their mask."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(2, vocab_size, (4, 9))
    mask = (np.arange(9) < np.array([9, 6, 3, 7])[:, None]).astype(np.int64)
    return ids * mask, mask


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """A random HF T5 and its folder, every tensor moved by N(0, 0.5^2) so that greedy outputs
    vary from step to step (at HF's init they repeat one token)."""
    model = hf_reference("T5ForConditionalGeneration", 0, scale=0.5, **HF_T5)
    folder = tmp_path_factory.mktemp("t5")
    model.save_pretrained(folder)
    return model, folder


def hf_greedy(model, ids, mask, new_tokens: int, eos: int) -> np.ndarray:
    """HF's greedy tokens without the start token, padded with 0 to `new_tokens`."""
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                             do_sample=False, num_beams=1, max_new_tokens=new_tokens,
                             min_new_tokens=0, eos_token_id=eos, pad_token_id=0).numpy()
    return np.pad(out[:, 1:], ((0, 0), (0, new_tokens + 1 - out.shape[1])))


def test_greedy_seq2seq_equals_hf_generate_and_stops_rows_at_eos(hf_pair):
    reference, folder = hf_pair
    ids, mask = sources(HF_T5["vocab_size"], seed=1)
    model = hf.load(folder)
    free = greedy_seq2seq(model, ids, mask, max_new_tokens=12)
    np.testing.assert_array_equal(free, hf_greedy(reference, ids, mask, 12, eos=1))
    # An end-of-sequence id that rows reach at different steps: each row keeps it, then pads.
    eos = int(free[3, 3])
    stopping = hf.load(folder, eos_token_id=eos)
    out = greedy_seq2seq(stopping, ids, mask, max_new_tokens=12)
    np.testing.assert_array_equal(out, hf_greedy(reference, ids, mask, 12, eos=eos))
    stops = []
    for row, tokens in zip(free, out, strict=True):
        stops.append(list(row).index(eos) + 1 if eos in row else 12)
        np.testing.assert_array_equal(tokens[:stops[-1]], row[:stops[-1]])
        assert (tokens[stops[-1]:] == 0).all()
    assert len(set(stops)) >= 3 and 12 in stops  # rows stop at different steps, one never
    with pytest.raises(UserError, match="max_new_tokens"):
        greedy_seq2seq(model, ids, mask, max_new_tokens=0)


def with_languages(table: np.ndarray) -> T5:
    """SMALL with language embeddings `table`, other parameters those of `plain()`."""
    model = T5(dataclasses.replace(SMALL, num_languages=len(table)), rngs=nnx.Rngs(0))
    nnx.update(model, nnx.state(plain(), nnx.Param))
    model.language_embeddings.embedding.set_value(jnp.asarray(table, jnp.float32))
    return model


def plain() -> T5:
    return random_model(T5, SMALL, 3)


def test_language_embeddings_add_to_tokens_in_encoder_and_decoder():
    ids, mask = sources(SMALL.vocab_size, seed=2)
    decoder_ids = ids[:, :5]
    zero, base = with_languages(np.zeros((2, 16))), plain()
    assert base.language_embeddings is None and zero.language_embeddings is not None
    languages = np.tile([[0], [1]], (2, 9))
    # A zero table is no table (and without the table the ids are refused).
    np.testing.assert_allclose(
        zero(ids, mask, decoder_ids, language_ids=languages,
             decoder_language_ids=languages[:, :5]).logits,
        base(ids, mask, decoder_ids).logits, atol=1e-6)
    with pytest.raises(ValueError, match="language_ids"):
        base.encode(ids, mask, language_ids=languages)
    with pytest.raises(ValueError, match="language_ids"):
        zero.encode(ids, mask)
    # A row of the table is added to each token embedding of that language, and changes the
    # output; encoder and decoder read the same table.
    table = np.random.default_rng(0).normal(size=(2, 16)).astype(np.float32)
    model = with_languages(table)
    np.testing.assert_allclose(model.embed(jnp.asarray(ids), jnp.asarray(languages)),
                               np.asarray(model.shared(jnp.asarray(ids))) + table[languages],
                               atol=1e-6)
    shifted = np.asarray(model.encode(ids, mask, language_ids=languages))
    assert not np.allclose(shifted, np.asarray(base.encode(ids, mask)), atol=1e-3)
    np.testing.assert_allclose(shifted[:2], np.asarray(
        model.encode(ids[:2], mask[:2], language_ids=languages[:2])), atol=1e-6)
    flipped = np.asarray(model.encode(ids, mask, language_ids=1 - languages))
    assert not np.allclose(shifted, flipped, atol=1e-3)
    encoded = jnp.asarray(shifted)
    decoded = [np.asarray(model.decode(decoder_ids, encoded, mask, language_ids=lang[:, :5]))
               for lang in (languages, 1 - languages)]
    assert not np.allclose(*decoded, atol=1e-3)
    # Greedy decoding passes the languages: target language 0 and 1 give other outputs.
    out = [greedy_seq2seq(model, ids, mask, max_new_tokens=6, source_language_ids=languages,
                          target_language_ids=np.full(4, lang)) for lang in (0, 1)]
    assert (out[0] != out[1]).any()
    with pytest.raises(UserError, match="^this T5 has language embeddings [^\n]*$"):
        t5_hf.config_to_hf(model.config)


# ------------------------------------------------------------------- translation fine-tune
SUBJECTS = [("A man", "Ein Mann"), ("A woman", "Eine Frau"), ("A child", "Ein Kind"),
            ("The dog", "Der Hund")]
VERBS = [("sees", "sieht"), ("has", "hat"), ("wants", "will"), ("likes", "mag")]
COLOURS = [("red", "rotes"), ("blue", "blaues"), ("green", "grünes"), ("black", "schwarzes")]
THINGS = [("car", "Auto"), ("boat", "Boot"), ("bike", "Fahrrad"), ("house", "Haus")]


def toy_parallel(root, split: str, count: int, seed: int) -> str:
    """`count` aligned English/German template captions in root/split.{en,de}; the spec."""
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(count):
        s, v, c, t = (table[rng.integers(len(table))] for table in (SUBJECTS, VERBS, COLOURS,
                                                                      THINGS))
        pairs.append((f"{s[0]} {v[0]} a {c[0]} {t[0]}.", f"{s[1]} {v[1]} ein {c[1]} {t[1]}."))
    for index, language in enumerate(("en", "de")):
        (root / f"{split}.{language}").write_text(
            "".join(pair[index] + "\n" for pair in pairs), encoding="utf-8")
    return f"{root / f'{split}.en'},{root / f'{split}.de'}"


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A toy corpus, its sentencepiece tokenizer and a random bilingual T5 saved as a model
    directory (what a mass_bilingual_tiny run exports)."""
    root = tmp_path_factory.mktemp("toy")
    train, val = toy_parallel(root, "train", 400, 0), toy_parallel(root, "val", 30, 1)
    text = (root / "train.en").read_text().splitlines() + (root / "train.de").read_text(
        ).splitlines()
    tokenizer = SentencePieceTokenizer.train(text, root / "spm", vocab_size=60)
    config = T5Config(
        vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_id, num_languages=2,
        hidden_size=32, num_layers=1, num_heads=2, head_size=16, intermediate_size=64,
        feed_forward_proj="gelu", hidden_dropout=0.0, attention_dropout=0.0)
    model = T5(T5Config(**{f.name: getattr(config, f.name)
                           for f in dataclasses.fields(T5Config)}), rngs=nnx.Rngs(0))
    save_model(model, "mass", root / "mass")
    directories.write_tokenizer(root / "mass", tokenizer)
    return {"root": root, "train": train, "val": val, "tokenizer": tokenizer,
            "init": root / "mass"}


def test_records_hold_both_sides_with_eos_and_languages(toy, tmp_path):
    tokenizer, config = toy["tokenizer"], te.TranslationExampleConfig(max_source_length=8,
                                                                        max_target_length=40)
    (tmp_path / "a.en").write_text("A man sees a red car.\n\nThe dog has a blue boat.\n")
    (tmp_path / "a.de").write_text("Ein Mann sieht ein rotes Auto.\nEin Kind\n\n")
    spec = f"{tmp_path / 'a.en'},{tmp_path / 'a.de'}"
    records, references = te.held_out_pairs(spec, tokenizer, config, {"de": 0, "en": 1})
    assert references == ["Ein Mann sieht ein rotes Auto."]  # pairs with an empty side dropped
    source = tokenizer.encode("A man sees a red car.")
    target = tokenizer.encode(references[0])
    assert len(source) > 7  # cut to 7 tokens and EOS
    np.testing.assert_array_equal(records["inputs"][0], [*source[:7], tokenizer.eos_id])
    np.testing.assert_array_equal(records["targets"][0, :len(target) + 1],
                                  [*target, tokenizer.eos_id])
    assert records["target_mask"][0].sum() == len(target) + 1
    assert (records["targets"][0, len(target) + 1:] == tokenizer.pad_id).all()
    assert (records["source_language_ids"] == 1).all() and (
        records["target_language_ids"] == 0).all()
    with pytest.raises(UserError, match="has no fr"):
        te.held_out_pairs(spec, tokenizer, dataclasses.replace(config, target_language="fr"),
                          {"de": 0, "en": 1})


def test_batches_within_a_token_budget_cut_both_sides(toy, tmp_path):
    """examples.tokens_per_batch: pairs of similar length together, rows x the longer side's
    length within the budget (fairseq's max_tokens), each side cut to that length without
    losing a token; the feed counts both sides' tokens; a step's loss is finite."""
    config = make_config("translation_tiny", {
        "data.source": toy["train"], "data.eval_source": toy["val"],
        "data.tokenizer": str(directories.find_tokenizer(toy["init"])),
        "data.cache_dir": str(tmp_path), "examples.tokens_per_batch": 960,
        "examples.length_buckets": 3,
        "examples.max_source_length": 48, "examples.max_target_length": 48,
        "model.hidden_size": 32, "model.num_heads": 2, "model.head_size": 16,
        "model.intermediate_size": 64, "model.num_layers": 1, "train.batch_size": 16})
    trainer = Trainer(config, tmp_path / "w")
    source = trainer.data.segment(1, trainer.run_config).records(None)
    assert len({rows for rows, _ in source.shapes()}) > 1
    for key in range(3):
        batch = source[key]
        rows, length = len(batch["inputs"]), max(batch["inputs"].shape[1],
                                                 batch["targets"].shape[1])
        assert (rows, length) in source.shapes()
        sides = batch["input_mask"].sum(1), batch["target_mask"].sum(1)
        assert int(batch.pop("batch_units")) == sum(sides).sum()  # both sides' tokens
        assert np.maximum(*sides).max() <= length
        assert (batch["input_mask"].sum(1) == source.records.examples(
            source.batch(key)[0])["input_mask"].sum(1)).all()  # nothing of a side was cut
    _, metrics = trainer.train_step(trainer.init_state(), batch)
    assert np.isfinite(float(metrics["loss"][0]))


@pytest.mark.usefixtures("deterministic_torch")
def test_loss_is_hf_t5_loss_with_labels(hf_pair):
    """Through the decoding protocol: targets shifted right after the start token, loss on the
    target tokens only."""
    reference, folder = hf_pair
    ids, mask = sources(HF_T5["vocab_size"], seed=5)
    targets = np.random.default_rng(6).integers(2, HF_T5["vocab_size"], (4, 7))
    target_mask = (np.arange(7) < np.array([7, 3, 5, 1])[:, None]).astype(np.int64)
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                             labels=torch.tensor(np.where(target_mask, targets, -100))).loss
    batch = {"inputs": ids, "input_mask": mask, "targets": targets * target_mask,
             "target_mask": target_mask, "source_language_ids": np.zeros_like(ids),
             "target_language_ids": np.zeros_like(targets)}
    family = translation.FAMILIES["translation"]
    loss, metrics = translation.translation_loss(
        hf.load(folder), {k: jnp.asarray(v) for k, v in batch.items()}, None, family=family)
    np.testing.assert_allclose(loss, expected.item(), atol=1e-5, rtol=0)
    assert metrics["target_tokens"][0] == target_mask.sum()


def test_bleu_check_decodes_by_beam_search_beside_greedy(toy):
    """`examples.num_beams` > 1: `bleu` is the BLEU of beam search's best outputs (with the
    settings' length penalty), `bleu_greedy` the greedy BLEU beside it; one beam: greedy only."""
    # Random weights of the toy's architecture whose outputs are not empty (its own init's are).
    model = random_model(T5, loading.load_model(toy["init"]).config, 1)
    tokenizer, family = toy["tokenizer"], translation.FAMILIES["translation"]
    examples = te.TranslationExampleConfig(max_source_length=20, max_target_length=8,
                                           bleu_sentences=6, num_beams=3, length_penalty=0.5)
    records, references = te.held_out_pairs(toy["val"], tokenizer, examples, {"de": 0, "en": 1})
    data = PreparedData(train=None, eval=records,
                        monitor_data=translation.HeldOut(references, tokenizer),
                        report={"held_out_pairs": 30, "bleu_signature": "sig",
                                "decoding": translation.decoding_name(examples)})
    scores = translation.bleu_monitor(model, data, examples, family=family)
    greedy = dataclasses.replace(examples, num_beams=1)
    assert translation.bleu_monitor(model, data, greedy, family=family) == {
        "bleu": scores["bleu_greedy"]}
    rows = np.minimum(np.arange(encoder_decoders.DECODE_BATCH), 5)  # the monitor's batch shape
    beams = beam_search(model, records["inputs"][rows], records["input_mask"][rows],
                        max_new_tokens=8, search=BeamSearch(num_beams=3, length_penalty=0.5),
                        source_language_ids=records["source_language_ids"][rows],
                        target_language_ids=records["target_language_ids"][rows, 0],
                        pad_id=tokenizer.pad_id).sequences[:6, 0]
    hypotheses = [tokenizer.decode(row.tolist()[:list(row).index(tokenizer.eos_id)
                                                if tokenizer.eos_id in row else 8])
                  for row in beams]
    assert all(hypotheses)
    assert scores["bleu"] == sacrebleu.corpus_bleu(hypotheses, [references[:6]]).score
    assert translation.translate_held_out(model, data, examples, family)[0] == hypotheses
    assert translation.translate_held_out(model, data, greedy, family)[0] != hypotheses
    assert "(beam 3, length penalty 0.5, greedy" in translation.summarize_translation(
        scores, data.report, None)[0]
    with pytest.raises(UserError, match="num_beams=0 must be >= 1"):
        dataclasses.replace(examples, num_beams=0)


def test_pretrained_model_keeps_its_weights_and_must_match(toy):
    family = translation.FAMILIES["translation"]
    saved = loading.load_model(toy["init"])
    config = T5TranslationConfig(**{**dataclasses.asdict(saved.config), "init": str(toy["init"]),
                                    "hidden_dropout": 0.2})
    model = encoder_decoders.pretrained_start(config, 0, loading.load_pretrained, family=family)
    assert model.config.hidden_dropout == 0.2
    np.testing.assert_array_equal(model.language_embeddings.embedding.get_value(),
                                  saved.language_embeddings.embedding.get_value())
    with pytest.raises(UserError, match=r"^model.num_languages=0 differs .* set "
                                        r"model.num_languages=2$"):
        encoder_decoders.pretrained_start(dataclasses.replace(config, num_languages=0), 0,
                                          loading.load_pretrained, family=family)
    assert encoder_decoders.pretrained_start(dataclasses.replace(config, init=""), 0,
                                             loading.load_pretrained, family=family) is None
    # A language the model has no embedding for (fr = 2 of de, en, fr) is refused.
    data = PreparedData(train=None, eval={"source_language_ids": np.array([[2, 2]]),
                                          "target_language_ids": np.array([[0, 0]])},
                        report={"language_ids": {"de": 0, "en": 1, "fr": 2}})
    with pytest.raises(UserError, match="has 2 language embeddings"):
        translation.check_languages(data, config, family=family)
    ok = dataclasses.replace(data, eval={**data.eval, "source_language_ids": np.ones((1, 2))})
    assert translation.check_languages(ok, config, family=family) is ok


def translate_toy(toy, init, workdir, cache) -> tuple[dict, list[dict]]:
    """`run.py translate --init INIT` on the toy corpus, 30 steps evaluated at 15 and 30:
    (results.json, the evaluation rows)."""
    assert run.main(["translate", "--init", str(init), "--data", toy["train"],
                     "--eval-data", toy["val"], "--workdir", str(workdir),
                     "train.steps=30", "train.batch_size=16", "optim.learning_rate=0.02",
                     "optim.warmup_steps=10", "train.eval_every=15", "train.log_every=15",
                     "examples.max_source_length=20", "examples.max_target_length=20",
                     f"data.cache_dir={cache}", "train.progress=false"]) == 0
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return (json.loads((workdir / "results.json").read_text()),
            [row for row in rows if row["split"] == "eval"])


def rescored_bleu(toy, workdir) -> float:
    """sacrebleu's corpus BLEU of the greedy translations by `workdir`'s final model of the toy's
    held-out sources, decoded here in one batch, cut at EOS and detokenised, against the
    corpus's sentences."""
    config = config_from_dict(directories.read_json_object(workdir / "config.json"))
    model, tokenizer = loading.load_model(workdir), toy["tokenizer"]
    records, references = te.held_out_pairs(toy["val"], tokenizer, config.examples,
                                            {"de": 0, "en": 1})
    languages = translation.FAMILIES[config.method].languages(model.config) > 0
    tokens = greedy_seq2seq(
        model, records["inputs"], records["input_mask"], max_new_tokens=20,
        source_language_ids=records["source_language_ids"] if languages else None,
        target_language_ids=np.zeros(len(references), np.int32) if languages else None)
    ends = [list(row).index(tokenizer.eos_id) if tokenizer.eos_id in row else len(row)
            for row in tokens]
    hypotheses = [tokenizer.decode(row[:end].tolist()) for row, end in zip(tokens, ends,
                                                                           strict=True)]
    return sacrebleu.corpus_bleu(hypotheses, [references]).score


def test_cli_translate_from_a_bilingual_mass_model_scores_bleu(toy, tmp_path):
    """`run.py translate --init MASS_DIR`: the starting point's architecture, tokenizer and
    languages; held-out loss falls; results.json's BLEU is sacrebleu's on the final model's
    greedy translations, with its signature."""
    workdir = tmp_path / "run"
    result, evaluations = translate_toy(toy, toy["init"], workdir, tmp_path / "cache")
    assert evaluations[-1]["loss"] < evaluations[0]["loss"] - 0.3, evaluations
    assert result["held_out_pairs"] == 30 and "tok:13a" in result["bleu_signature"]
    config = config_from_dict(directories.read_json_object(workdir / "config.json"))
    assert config.method == "translation" and config.model.num_languages == 2
    assert result["bleu"] == pytest.approx(rescored_bleu(toy, workdir), abs=1e-9)
    # The from-scratch baseline: same architecture and tokenizer, no init.
    baseline = translate.translation_config("", toy["train"], toy["val"],
                                            architecture=str(toy["init"]))
    assert baseline.model.init == "" and baseline.model.num_languages == 2
    assert baseline.data.tokenizer == config.data.tokenizer


def pretrained_directory(toy, kind: str):
    """A random pre-trained ProphetNet or bilingual XLM saved as a model directory with the toy
    tokenizer (what a prophetnet / xlm run exports)."""
    tokenizer, folder = toy["tokenizer"], toy["root"] / kind
    if kind == "prophetnet":
        model: nnx.Module = ProphetNet(ProphetNetConfig(
            vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_id, hidden_size=32,
            num_encoder_layers=1, num_decoder_layers=1, num_encoder_attention_heads=2,
            num_decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
            max_position_embeddings=64), rngs=nnx.Rngs(0))
    else:
        model = XLM(XLMConfig(
            vocab_size=tokenizer.vocab_size, n_langs=2, pad_token_id=tokenizer.pad_id,
            hidden_size=32, num_layers=1, num_heads=2, intermediate_size=128,
            max_position_embeddings=64, embed_init_std=32 ** -0.5), rngs=nnx.Rngs(0))
    if not folder.exists():
        save_model(model, kind, folder)
        directories.write_tokenizer(folder, tokenizer)
    return folder, model


@pytest.mark.parametrize("kind,method", [("prophetnet", "translation_prophetnet"),
                                         ("xlm", "translation_xlm")])
def test_prophetnet_and_xlm_fine_tune_on_translation_from_their_pretrained_weights(
        toy, tmp_path, kind, method):
    """`run.py translate --init` from a ProphetNet (decoded through stream 0) and from an XLM,
    whose weights start both the encoder and the decoder (§5.2; the decoder's cross-attention
    is new): the method is the family's, the held-out loss falls, BLEU is reported."""
    folder, pretrained = pretrained_directory(toy, kind)
    config = translate.translation_config(str(folder), toy["train"], toy["val"])
    assert config.method == method and config.model.init == str(folder)
    family = translation.FAMILIES[method]
    started = encoder_decoders.pretrained_start(config.model, 0,
                                                loading.load_pretrained, family=family)
    sides = (started.encoder, started.decoder) if kind == "xlm" else (started,)
    for side in sides:
        own = dict(nnx.to_flat_state(nnx.state(side, nnx.Param)))
        for key, value in nnx.to_flat_state(nnx.state(pretrained, nnx.Param)):
            np.testing.assert_array_equal(own[key][...], value[...])
    workdir = tmp_path / "run"
    result, evaluations = translate_toy(toy, folder, workdir, tmp_path / "cache")
    chance = np.log(toy["tokenizer"].vocab_size)  # a uniform prediction's loss
    assert evaluations[-1]["loss"] < min(evaluations[0]["loss"], chance - 0.3), evaluations
    assert result["held_out_pairs"] == 30
    # results.json's BLEU is sacrebleu's on the final model's greedy translations.
    assert result["bleu"] == pytest.approx(rescored_bleu(toy, workdir), abs=1e-9)
    assert type(loading.load_model(workdir)) is family.model_class


def test_a_mass_xlm_run_starts_translation_xlm_with_all_its_weights(toy):
    """A MASS run on XLM's encoder-decoder (method mass_xlm, one cross-attention output per
    language) is fine-tuned by translation_xlm: every parameter copied, the per-language
    outputs kept, greedy decoding runs through them."""
    tokenizer, folder = toy["tokenizer"], toy["root"] / "mass_xlm"
    pretrained = XLMTranslation(XLMTranslationConfig(
        vocab_size=tokenizer.vocab_size, n_langs=2, pad_token_id=tokenizer.pad_id,
        eos_token_id=tokenizer.eos_id, hidden_size=32, num_layers=1, num_heads=2,
        intermediate_size=128, max_position_embeddings=64, embed_init_std=32 ** -0.5,
        cross_output_per_language=True), rngs=nnx.Rngs(0))
    save_model(pretrained, "mass_xlm", folder)
    directories.write_tokenizer(folder, tokenizer)
    config = translate.translation_config(str(folder), toy["train"], toy["val"])
    assert config.method == "translation_xlm" and config.model.cross_output_per_language
    started = encoder_decoders.pretrained_start(
        config.model, 0, loading.load_pretrained, family=translation.FAMILIES[config.method])
    own = dict(nnx.to_flat_state(nnx.state(started, nnx.Param)))
    weights = list(nnx.to_flat_state(nnx.state(pretrained, nnx.Param)))
    assert len(weights) == len(own)
    for key, value in weights:
        np.testing.assert_array_equal(own[key][...], value[...], err_msg=str(key))
    sources = np.asarray([tokenizer.encode("A man sees a red car.") + [tokenizer.eos_id]])
    tokens = greedy_seq2seq(started, sources, max_new_tokens=5,
                            source_language_ids=np.ones_like(sources),
                            target_language_ids=np.zeros(1, np.int32))
    assert tokens.shape == (1, 5)
