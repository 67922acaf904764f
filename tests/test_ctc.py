"""CTC fine-tuning of wav2vec 2.0: the loss and greedy decoding against numpy re-statements,
parity with HF `Wav2Vec2ForCTC` (logits and loss) and its import and export."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from parity_utils import Parity, converted, random_model
from test_wav2vec2 import HF_TINY, NO_DROPOUT, TINY, padded_waveforms

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.transcripts import CharVocabulary, read_transcripts
from pretext_jax.models.wav2vec2 import (
    Wav2Vec2,
    Wav2Vec2CTCConfig,
    Wav2Vec2ForCTC,
    with_body_of,
)
from pretext_jax.objectives.common.ctc import ctc_loss, error_rates, greedy_decode

VOCAB = 7
TINY_CTC = Wav2Vec2CTCConfig(**dataclasses.asdict(TINY), vocab_size=VOCAB, blank_id=0)
CTC_NO_DROPOUT = {**NO_DROPOUT, "final_dropout": 0.0}


def numpy_ctc(log_probs: np.ndarray, labels: list[int], blank: int = 0) -> float:
    """-log p(labels | frames) by the forward algorithm (Graves et al. 2006 §4.1) over the
    labels with a blank before, between and after them; `log_probs` [T, V] normalised."""
    extended = [blank]
    for label in labels:
        extended += [label, blank]
    alpha = np.full(len(extended), -np.inf)
    alpha[0] = log_probs[0, blank]
    if labels:
        alpha[1] = log_probs[0, labels[0]]
    for t in range(1, len(log_probs)):
        previous = alpha.copy()
        for s, symbol in enumerate(extended):
            paths = [previous[s]] + ([previous[s - 1]] if s >= 1 else [])
            if s >= 2 and symbol != blank and symbol != extended[s - 2]:
                paths.append(previous[s - 2])
            alpha[s] = np.logaddexp.reduce(paths) + log_probs[t, symbol]
    return -float(np.logaddexp(alpha[-1], alpha[-2]) if labels else alpha[-1])


def numpy_greedy(logits: np.ndarray, blank: int = 0) -> list[int]:
    """Best path: argmax per frame, runs of one class merged, blanks removed."""
    out, previous = [], None
    for label in logits.argmax(-1):
        if label != previous and label != blank:
            out.append(int(label))
        previous = label
    return out


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def ctc_batch(seed: int = 0):
    """Logits [3, 12, 7] with 12, 9 and 5 real frames; transcripts of 4 (a doubled label), 3
    and 0 characters, padded with -100."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((3, 12, VOCAB)).astype(np.float32) * 2
    frames = np.arange(12)[None] < np.array([12, 9, 5])[:, None]
    transcripts = [[3, 3, 1, 5], [2, 6, 2], []]
    labels = np.full((3, 4), -100)
    for row, transcript in zip(labels, transcripts, strict=True):
        row[:len(transcript)] = transcript
    return logits, frames, labels, transcripts


def test_ctc_loss_matches_the_forward_algorithm_and_each_reduction():
    logits, frames, labels, transcripts = ctc_batch()
    expected = np.array([numpy_ctc(log_softmax(lg[f]), t)
                         for lg, f, t in zip(logits, frames, transcripts, strict=True)])
    lengths = np.array([len(t) for t in transcripts])
    for reduction, reduced in (("sum", expected.sum()),
                               ("mean", np.mean(expected / np.maximum(lengths, 1))),
                               ("sentences", expected.mean()),
                               ("tokens", expected.sum() / lengths.sum())):
        loss, per_utterance = ctc_loss(jnp.asarray(logits), jnp.asarray(frames),
                                       jnp.asarray(labels), reduction=reduction)
        np.testing.assert_allclose(per_utterance, expected, rtol=1e-5)
        np.testing.assert_allclose(loss, reduced, rtol=1e-5)
    # Negative controls: another transcript, or padded frames read as real, change the loss.
    wrong = numpy_ctc(log_softmax(logits[0]), [3, 1, 5])
    assert abs(wrong - expected[0]) > 1e-2
    _, all_real = ctc_loss(jnp.asarray(logits), jnp.ones_like(jnp.asarray(frames)),
                           jnp.asarray(labels))
    assert abs(float(all_real[1]) - expected[1]) > 1e-2
    with pytest.raises(ValueError, match="reduction"):
        ctc_loss(jnp.asarray(logits), jnp.asarray(frames), jnp.asarray(labels),
                 reduction="batch")


def test_greedy_decoding_collapses_repeats_and_drops_blanks():
    logits, frames, _, _ = ctc_batch(1)
    # Row 0's path: a a _ a b b _ _ c ... : the blank keeps the doubled "a".
    path = [3, 3, 0, 3, 1, 1, 0, 0, 5, 5, 0, 2]
    logits[0] = np.eye(VOCAB, dtype=np.float32)[path] * 10
    decoded = greedy_decode(logits, frames)
    assert decoded[0] == [3, 3, 1, 5, 2]
    for row, f, got in zip(logits, frames, decoded, strict=True):
        assert got == numpy_greedy(row[f])
    # Negative control: row 2's padded frames say 4; read as real, they would be decoded.
    logits[2, 5:] = np.eye(VOCAB, dtype=np.float32)[4] * 10
    assert greedy_decode(logits, frames)[2] == decoded[2]
    assert greedy_decode(logits, np.ones_like(frames))[2] == decoded[2] + [4]


@pytest.fixture(scope="module")
def hf_ctc_folders(tmp_path_factory):
    """A perturbed random tiny HF `Wav2Vec2ForCTC` per layout (BASE, LV-60), saved."""
    pytest.importorskip("transformers")
    from parity_utils import hf_reference

    folders = {}
    for name, extra in (("base", {}), ("lv60", {"feat_extract_norm": "layer",
                                                "conv_bias": True,
                                                "do_stable_layer_norm": True})):
        folders[name] = tmp_path_factory.mktemp(name)
        hf_reference("Wav2Vec2ForCTC", 2, **HF_TINY, **extra, vocab_size=VOCAB,
                     pad_token_id=0, ctc_loss_reduction="mean").save_pretrained(folders[name])
    return folders


def hf_ctc(model, waveforms, mask, labels):
    out = model(waveforms, attention_mask=mask, labels=labels)
    model.config.ctc_loss_reduction = "sum"
    summed = model(waveforms, attention_mask=mask, labels=labels).loss
    model.config.ctc_loss_reduction = "mean"
    return {"logits": out.logits, "loss": out.loss, "loss_sum": summed}


def our_ctc(model: Wav2Vec2ForCTC, waveforms, mask, labels):
    logits, frames = model(waveforms, mask)
    return {"logits": jnp.where(frames[..., None], logits, 0.0),
            "loss": ctc_loss(logits, frames, labels, blank_id=model.config.blank_id)[0],
            "loss_sum": ctc_loss(logits, frames, labels, reduction="sum")[0]}


def hf_ctc_padded_logits(model, waveforms, mask, labels):
    out = hf_ctc(model, waveforms, mask, labels)
    frames = model._get_feature_vector_attention_mask(out["logits"].shape[1], mask)
    return {**out, "logits": out["logits"] * frames[..., None]}


# rtol 3e-7: the summed loss (~200) is one or two float32 units in the last place from HF's
# (1.5e-5 each), by CPU (two on an AVX-512 Xeon, one on CI's); the mean loss and the logits meet
# the absolute 1e-5 alone.
PARITY = Parity("Wav2Vec2ForCTC", hf_ctc_padded_logits, our_ctc, rtol=3e-7)


def ctc_inputs(seed: int):
    waveforms, mask = padded_waveforms(seed)
    labels = np.full((3, 6), -100)
    labels[0, :6], labels[1, :4], labels[2, :2] = [1, 2, 2, 3, 4, 6], [5, 1, 5, 3], [2, 2]
    return waveforms, mask, labels


@pytest.mark.usefixtures("deterministic_torch")
@pytest.mark.parametrize("layout", ["base", "lv60"])
def test_parity_with_hf_wav2vec2_for_ctc(hf_ctc_folders, layout):
    """HF's checkpoint loads without a warning; logits on real frames and the mean and summed
    CTC losses within 1e-5 on a padded batch; a wrong blank is a negative control."""
    import transformers

    reference = transformers.Wav2Vec2ForCTC.from_pretrained(hf_ctc_folders[layout]).eval()
    ours = converted(reference, hf_ctc_folders[layout] / "again", **CTC_NO_DROPOUT)
    assert isinstance(ours, Wav2Vec2ForCTC) and ours.config.vocab_size == VOCAB
    expected = PARITY.assert_parity(ours, reference, *ctc_inputs(0), atol=1e-5)
    logits, frames = ours(*(jnp.asarray(a) for a in ctc_inputs(0)[:2]))
    wrong_blank = ctc_loss(logits, frames, jnp.asarray(ctc_inputs(0)[2]), blank_id=1)[0]
    assert abs(float(wrong_blank) - float(expected["loss"])) > 1e-3


@pytest.mark.usefixtures("deterministic_torch")
def test_round_trip_through_transformers(tmp_path):
    pytest.importorskip("transformers")
    ours = random_model(Wav2Vec2ForCTC, TINY_CTC, 3)
    _, saved = PARITY.round_trip(ours, tmp_path / "hf", *ctc_inputs(1), **CTC_NO_DROPOUT)
    assert saved["architectures"] == ["Wav2Vec2ForCTC"] and saved["vocab_size"] == VOCAB


def test_bad_ctc_configs():
    with pytest.raises(ValueError, match="blank_id"):
        dataclasses.replace(TINY_CTC, blank_id=VOCAB)


# --- Vocabulary and manifests ----------------------------------------------------------------

def test_vocabulary_round_trips_through_hf_tokenizer(tmp_path):
    """Our vocab.json is HF `Wav2Vec2CTCTokenizer`'s: the same ids for a transcript and the
    same text back; a character outside it is a one-line error naming the line."""
    vocabulary = CharVocabulary.from_transcripts(["HELLO WORLD", "HE SAID"])
    assert vocabulary.tokens[:5] == ("<pad>", "<s>", "</s>", "<unk>", "|")
    assert vocabulary.tokens[5] == "L" and vocabulary.blank_id == 0  # most frequent first
    vocabulary.save(tmp_path / "vocab.json")
    assert CharVocabulary.load(tmp_path / "vocab.json") == vocabulary
    ids = vocabulary.encode("HELLO  WORLD")
    assert vocabulary.decode(ids) == "HELLO WORLD"
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.Wav2Vec2CTCTokenizer(str(tmp_path / "vocab.json"))
    assert tokenizer("HELLO WORLD").input_ids == ids
    assert tokenizer.decode(ids, group_tokens=False) == "HELLO WORLD"
    with pytest.raises(UserError, match=r"t.tsv:3: character 'x' is not in the vocabulary"):
        vocabulary.encode("HEx", "t.tsv:3")
    with pytest.raises(UserError, match="no '<pad>'"):
        CharVocabulary(("a", "|"))


def test_manifests_tsv_and_librispeech(tmp_path):
    (tmp_path / "a.wav").touch()
    (tmp_path / "tsv").write_text("a.wav\tHELLO WORLD\n\nmissing.wav\tHI\n")
    with pytest.raises(UserError, match=r"tsv:3: audio file .*missing.wav does not exist"):
        read_transcripts(tmp_path / "tsv")
    (tmp_path / "tsv").write_text(f"a.wav\tHELLO WORLD\n{tmp_path / 'a.wav'}\tHI\n")
    assert [(u.audio.name, u.text) for u in read_transcripts(tmp_path / "tsv")] == [
        ("a.wav", "HELLO WORLD"), ("a.wav", "HI")]
    (tmp_path / "tsv").write_text("a.wav HELLO\n")
    with pytest.raises(UserError, match="tsv:1: expected 'audio path<TAB>transcript'"):
        read_transcripts(tmp_path / "tsv")
    chapter = tmp_path / "libri" / "19" / "198"
    chapter.mkdir(parents=True)
    (chapter / "19-198-0000.flac").touch()
    (chapter / "19-198.trans.txt").write_text("19-198-0000 NORTHANGER ABBEY\n")
    [utterance] = read_transcripts(tmp_path / "libri")
    assert utterance.audio == chapter / "19-198-0000.flac"
    assert utterance.text == "NORTHANGER ABBEY" and utterance.where.endswith("trans.txt:1")
    (chapter / "19-198.trans.txt").write_text("19-198-0000 A\n19-198-0001 B\n")
    with pytest.raises(UserError, match=r"19-198.trans.txt:2: audio file .*0001.flac"):
        read_transcripts(tmp_path / "libri")


def levenshtein(a: list[str], b: list[str]) -> int:
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        row, previous = [i], row
        for j, y in enumerate(b, 1):
            row.append(min(previous[j] + 1, row[j - 1] + 1, previous[j - 1] + (x != y)))
    return row[-1]


def test_error_rates_are_corpus_edit_distances_and_the_empty_baseline_is_one():
    references = ["THE CAT SAT", "ON THE MAT", "ZERO"]
    hypotheses = ["THE CAT SAT", "ON A MAT", "ZERO ONE"]
    words = sum(levenshtein(r.split(), h.split()) for r, h in zip(references, hypotheses,
                                                                  strict=True))
    chars = sum(levenshtein(list(r), list(h)) for r, h in zip(references, hypotheses,
                                                             strict=True))
    rates = error_rates(references, hypotheses)
    assert rates["wer"] == pytest.approx(words / 7) and words == 2
    assert rates["cer"] == pytest.approx(chars / sum(map(len, references)))
    assert error_rates(references, [""] * 3) == {"wer": 1.0, "cer": 1.0}
    assert error_rates(references, references) == {"wer": 0.0, "cer": 0.0}


def test_a_pretrained_body_moves_into_the_ctc_model():
    """The pre-training model's body, parameter for parameter, under a new output layer: the
    same context-network states; another hidden size is refused."""
    pretrained = random_model(Wav2Vec2, TINY, 4)
    model = with_body_of(pretrained, random_model(Wav2Vec2ForCTC, TINY_CTC, 5))
    waveforms, mask = (jnp.asarray(a) for a in padded_waveforms(2))
    np.testing.assert_array_equal(model.hidden_states(waveforms, mask)[0],
                                  pretrained.hidden_states(waveforms, mask)[0])
    assert not np.array_equal(random_model(Wav2Vec2ForCTC, TINY_CTC, 5).hidden_states(
        waveforms, mask)[0], pretrained.hidden_states(waveforms, mask)[0])
    wide = dataclasses.replace(TINY_CTC, intermediate_size=40)
    with pytest.raises(ValueError, match="intermediate"):
        with_body_of(pretrained, random_model(Wav2Vec2ForCTC, wide, 5))


# --- The run: run.py finetune --task ctc ------------------------------------------------------

@pytest.fixture(scope="module")
def transcribed(tmp_path_factory):
    """24 utterances of 0.2 s, "ONE" a low tone and "TWO" a high one, as train (16) and dev
    (8, the test mesh's data shards) TSV manifests, and a random tiny wav2vec 2.0 saved as a
    HF folder."""
    soundfile = pytest.importorskip("soundfile")
    from pretext_jax.pretrain import hf

    root = tmp_path_factory.mktemp("ctc")
    t = np.arange(3200) / 16000
    rows = []
    for i in range(24):
        word, pitch = ("ONE", 300) if i % 2 else ("TWO", 2000)
        samples = 0.3 * np.sin(2 * np.pi * (pitch + 10 * i) * t)
        soundfile.write(str(root / f"{i}.wav"), samples.astype(np.float32), 16000)
        rows.append(f"{i}.wav\t{word}")
    (root / "train.tsv").write_text("\n".join(rows[:16]) + "\n")
    (root / "dev.tsv").write_text("\n".join(rows[16:]) + "\n")
    hf.save(random_model(Wav2Vec2, TINY, 6), root / "w2v")
    return root


def test_finetune_cli_trains_reports_wer_and_refuses_bad_manifests(transcribed, tmp_path,
                                                                   capsys):
    import run
    from pretext_jax.pretrain.finetune import _against_baseline, finetune_config

    data = f"{transcribed / 'train.tsv'},{transcribed / 'dev.tsv'}"
    init = str(transcribed / "w2v")
    config = finetune_config("ctc", init, data)
    assert config.method == "ctc" and config.optim.schedule == "tri_stage"
    assert config.train.steps == 20000 and config.optim.hold_steps == 8000
    assert config.model.hidden_size == TINY.hidden_size
    assert config.objective.freeze_updates == 10000
    fast = ["train.batch_size=8", "train.progress=false", "optim.warmup_steps=1",
            "optim.hold_steps=1", "objective.freeze_updates=2", "examples.max_samples=3200",
            "objective.channel_mask_fraction=0.1", "objective.channel_mask_span=4"]
    workdir = tmp_path / "run"
    assert run.main(["finetune", "--task", "ctc", "--init", init, "--data", data,
                     "--workdir", str(workdir), "--epochs", "2", *fast]) == 0
    out = capsys.readouterr().out
    trained = out[out.index("ctc dev after"):].strip()
    # Four updates at the recipe's 5e-5 leave the network at the blank: WER 1, flagged.
    assert re.match(r"ctc dev after 4 steps: wer [0-9.]+ \(empty transcript 1.0000\), cer "
                    r"[0-9.]+ \(empty transcript 1.0000\)\n  the run ended at the empty "
                    r"transcript baseline", trained), trained
    result = json.loads((workdir / "results.json").read_text())
    assert set(result["dev"]) == {"wer", "cer"} and result["at_empty_baseline"]
    assert not _against_baseline({"wer": 0.4, "cer": 0.2}, {"empty_baseline": {"wer": 1.0}},
                                 "ctc")["at_empty_baseline"]  # lower is better
    assert run.main(["convert", str(workdir), str(tmp_path / "hf"), "--to", "hf"]) == 0
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert saved["architectures"] == ["Wav2Vec2ForCTC"] and saved["vocab_size"] == 4 + 1 + 5
    capsys.readouterr()
    # Bad manifests: one line on stderr, exit 2, no records written.
    bad = tmp_path / "bad.tsv"
    bad.write_text(f"{transcribed / '0.wav'}\tTWO\n{transcribed / 'nine.wav'}\tNINE\n")
    cache = tmp_path / "cache"
    for manifest, message in ((bad, "bad.tsv:2: audio file"),):
        assert run.main(["finetune", "--task", "ctc", "--init", init, "--data",
                         f"{manifest},{transcribed / 'dev.tsv'}", "--workdir",
                         str(tmp_path / "bad_run"), f"data.cache_dir={cache}", *fast]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and message in err, err
    bad.write_text(f"{transcribed / '0.wav'}\tTWO\n")
    (tmp_path / "dev.tsv").write_text(f"{transcribed / '1.wav'}\tONE!\n")
    assert run.main(["finetune", "--task", "ctc", "--init", init, "--data",
                     f"{bad},{tmp_path / 'dev.tsv'}", "--workdir", str(tmp_path / "bad_run"),
                     f"data.cache_dir={cache}", *fast]) == 2
    err = capsys.readouterr().err.strip()
    assert "dev.tsv:1: character 'N' is not in the vocabulary" in err, err
    assert not cache.exists() or not any(cache.rglob("*.array_record"))
    assert not (tmp_path / "bad_run").exists()


def test_fsdd_bench_manifests_follow_the_official_split(tmp_path):
    """bench/ctc_fsdd.py: recordings 0-4 of each digit and speaker are dev, the rest train; the
    transcript is the digit's word, read back by the manifest reader's line format."""
    from bench.ctc_fsdd import write_manifests

    recordings = tmp_path / "recordings"
    recordings.mkdir()
    for digit, speaker, index in ((7, "jackson", 0), (7, "jackson", 4), (7, "jackson", 5),
                                  (0, "theo", 49)):
        (recordings / f"{digit}_{speaker}_{index}.wav").touch()
    train, dev = write_manifests(recordings, tmp_path / "manifests")
    rows = {name: [line.split("\t") for line in path.read_text().splitlines()]
            for name, path in (("train", train), ("dev", dev))}
    assert [(p.rsplit("/", 1)[1], word) for p, word in rows["dev"]] == [
        ("7_jackson_0.wav", "seven"), ("7_jackson_4.wav", "seven")]
    assert [(p.rsplit("/", 1)[1], word) for p, word in rows["train"]] == [
        ("0_theo_49.wav", "zero"), ("7_jackson_5.wav", "seven")]
    with pytest.raises(SystemExit, match="no FSDD recordings"):
        write_manifests(tmp_path / "manifests", tmp_path / "other")


# --- The recipes per labelled-data size, and resume --------------------------------------------

def test_each_recipe_preset_reaches_the_finetuning_config(transcribed):
    """`finetune_config(..., recipe=NAME)` (`run.py finetune --recipe`): every value of each
    fairseq base_* preset, the network from the starting point; no recipe is base_10h; a name
    that is not one of the method's recipes is refused naming them."""
    from pretext_jax.objectives import ctc, registry
    from pretext_jax.pretrain.finetune import finetune_config

    data = f"{transcribed / 'train.tsv'},{transcribed / 'dev.tsv'}"
    init = str(transcribed / "w2v")
    assert tuple(ctc.PRESETS) == ("ctc_base_10m", "ctc_base_1h", "ctc_base_10h",
                                  "ctc_base_100h", "ctc_base_960h")
    configs = {name: finetune_config("ctc", init, data, recipe=name) for name in ctc.PRESETS}
    for name, config in configs.items():
        preset = registry.preset(name)
        assert preset.pop("method") == config.method == "ctc"
        for section, values in preset.items():
            for key, value in values.items():
                assert getattr(getattr(config, section), key) == value, (name, section, key)
        assert config.model.hidden_size == TINY.hidden_size  # the starting network's size
        o = config.optim  # fairseq's phase_ratio [0.1, 0.4, 0.5]
        decay = config.train.steps - o.warmup_steps - o.hold_steps
        assert (o.warmup_steps * 10, o.hold_steps * 10, decay * 10) == (
            config.train.steps, 4 * config.train.steps, 5 * config.train.steps), name
    # The yaml files' own numbers (mask_prob / mask_length, mask_channel_prob / 64).
    table = {name: (c.train.steps, c.optim.learning_rate, c.objective.mask_start_fraction * 10,
                    c.objective.channel_mask_fraction * 64, c.model.layerdrop,
                    c.objective.freeze_updates) for name, c in configs.items()}
    assert table == {"ctc_base_10m": (13000, 5e-5, 0.65, 0.25, 0.1, 10000),
                     "ctc_base_1h": (13000, 5e-5, 0.65, 0.25, 0.1, 10000),
                     "ctc_base_10h": (20000, 5e-5, 0.65, 0.5, 0.05, 10000),
                     "ctc_base_100h": (80000, 3e-5, 0.65, 0.5, 0.1, 0),
                     "ctc_base_960h": (320000, 1e-4, 0.5, 0.1, 0.1, 0)}
    assert finetune_config("ctc", init, data) == configs["ctc_base_10h"]
    assert finetune_config("ctc", init, data, ["optim.learning_rate=1e-3"],
                           recipe="ctc_base_100h").optim.learning_rate == 1e-3  # overrides win
    for wrong in ("ctc_base_5h", "bert_base"):
        with pytest.raises(UserError, match=f"--recipe {wrong}: .*ctc_base_10m, ctc_base_1h"):
            finetune_config("ctc", init, data, recipe=wrong)


def test_a_recipe_run_resumed_equals_the_straight_run(transcribed, tmp_path, capsys):
    """`run.py finetune --recipe ctc_base_100h` trains with that recipe; the same run stopped
    after 2 of its 4 steps and resumed equals it bit for bit (losses, parameters, Adam's state,
    the `updates` counter that ends the frozen transformer at step 3, after the resume)."""
    from resilience_utils import flat_params, train_losses

    import run
    from pretext_jax.pretrain.finetune import finetune, finetune_config
    from pretext_jax.pretrain.trainer import Trainer

    data = f"{transcribed / 'train.tsv'},{transcribed / 'dev.tsv'}"
    init = str(transcribed / "w2v")
    fast = ["train.batch_size=8", "train.progress=false", "optim.warmup_steps=1",
            "optim.hold_steps=1", "objective.freeze_updates=3", "examples.max_samples=3200",
            "optim.learning_rate=1e-3", "objective.channel_mask_fraction=0.1",
            "objective.channel_mask_span=4", f"data.cache_dir={tmp_path / 'cache'}"]
    assert run.main(["finetune", "--task", "ctc", "--init", init, "--data", data, "--workdir",
                     str(tmp_path / "straight"), "--recipe", "ctc_base_100h", "--epochs", "2",
                     *fast]) == 0
    assert "ctc dev after 4 steps" in capsys.readouterr().out
    config = finetune_config("ctc", init, data, fast, epochs=2, recipe="ctc_base_100h")
    saved = json.loads((tmp_path / "straight" / "config.json").read_text())
    assert saved == json.loads(config.to_json()) and saved["model"]["layerdrop"] == 0.1
    resumed_dir = tmp_path / "resumed"
    assert Trainer(config, resumed_dir).run(stop_after=2)["step"] == 2
    assert finetune(config, resumed_dir)["steps"] == 4
    assert train_losses(resumed_dir) == train_losses(tmp_path / "straight")
    states = []
    for name in ("straight", "resumed"):
        trainer = Trainer(config, tmp_path / name)
        state, _ = trainer.checkpoints.restore(4)
        trainer.checkpoints.close()
        states.append(flat_params({"params": state.params, "model_state": state.model_state,
                                   "opt_state": state.opt_state}))
    straight, resumed = states
    assert straight.keys() == resumed.keys()
    for key in straight:
        np.testing.assert_array_equal(straight[key], resumed[key], err_msg=key)
    assert [int(v) for k, v in resumed.items() if "updates" in k] == [4], resumed.keys()


# --- CPC's context network: method ctc_cpc ------------------------------------------------------
TINY_CPC = {"conv_channels": 16, "context_size": 12, "prediction_steps": 2, "conv_norm": "layer"}


def test_cpc_ctc_head_reads_the_context_vectors_and_freezes_as_asked():
    """`CPCForCTC`: logits = the output layer on CPC's c_t, frames = CPC's real frames; the
    gradient reaches every part (`all`), g_ar and the layer (`context`), the layer alone
    (`head`)."""
    from flax import nnx

    from pretext_jax.objectives.ctc_cpc import CPCCTCModelConfig, build_cpc_ctc

    model = build_cpc_ctc(CPCCTCModelConfig(**TINY_CPC, vocab_size=VOCAB), 3)
    waveforms, mask = (jnp.asarray(a) for a in padded_waveforms(2))  # 1,200 samples: 7 frames
    logits, frames = model(waveforms, mask)
    expected = model.cpc(waveforms, mask)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(model.lm_head(expected.context)),
                               atol=1e-6)
    np.testing.assert_array_equal(np.asarray(frames), np.asarray(expected.frames))
    assert frames.shape == (3, 7) and int(frames[2].sum()) < int(frames[1].sum()) < 7

    def gradient_norms(trainable: str) -> dict[str, float]:
        def loss(m):
            out, real = m(waveforms, mask, None, trainable)
            return jnp.sum(jnp.where(real[..., None], out, 0.0) ** 2)
        grads = nnx.grad(loss)(model)
        return {part: float(sum(jnp.sum(g ** 2) for g in jax.tree.leaves(
                    nnx.state(grads, nnx.Param)[part] if part != "cpc.conv" else
                    nnx.state(grads, nnx.Param)["cpc"]["conv_layers"])))
                for part in ("lm_head", "cpc.conv")} | {"gru": float(sum(
                    jnp.sum(g ** 2) for g in jax.tree.leaves(
                        nnx.state(grads, nnx.Param)["cpc"]["gru"])))}

    reached = {t: {part for part, n in gradient_norms(t).items() if n > 0}
               for t in ("all", "context", "head")}
    assert reached == {"all": {"lm_head", "cpc.conv", "gru"}, "context": {"lm_head", "gru"},
                       "head": {"lm_head"}}


def test_finetune_from_a_cpc_run_chooses_ctc_cpc_and_starts_from_its_network(transcribed,
                                                                              tmp_path, capsys):
    from flax import nnx

    import run
    from pretext_jax.models.cpc import CPCConfig
    from pretext_jax.objectives import ctc_cpc
    from pretext_jax.objectives.cpc import build_cpc
    from pretext_jax.pretrain.export import save_model
    from pretext_jax.pretrain.finetune import finetune_config

    cpc = build_cpc(CPCConfig(**TINY_CPC), 8)
    init = str(save_model(cpc, "cpc", tmp_path / "cpc"))
    data = f"{transcribed / 'train.tsv'},{transcribed / 'dev.tsv'}"
    config = finetune_config("ctc", init, data)
    assert config.method == "ctc_cpc" and config.model.context_size == 12
    assert (config.optim.learning_rate, config.train.batch_size) == (2e-4, 8)
    model = ctc_cpc.pretrained_cpc_ctc(dataclasses.replace(config.model, vocab_size=VOCAB), 0,
                                       lambda path: cpc)
    for (path, ours), (_, theirs) in zip(nnx.to_flat_state(nnx.state(model.cpc, nnx.Param)),
                                         nnx.to_flat_state(nnx.state(cpc, nnx.Param)),
                                         strict=True):
        np.testing.assert_array_equal(np.asarray(ours.get_value()),
                                      np.asarray(theirs.get_value()), err_msg=str(path))
    wide = dataclasses.replace(config.model, vocab_size=VOCAB, context_size=16)
    with pytest.raises(UserError, match="model.context_size is 12 there, 16 here"):
        ctc_cpc.pretrained_cpc_ctc(wide, 0, lambda path: cpc)
    fast = ["train.batch_size=8", "train.progress=false", "examples.max_samples=3200",
            "optim.learning_rate=3e-3"]
    workdir = tmp_path / "run"
    assert run.main(["finetune", "--task", "ctc", "--init", init, "--data", data,
                     "--workdir", str(workdir), "--epochs", "4", *fast]) == 0
    out = capsys.readouterr().out
    assert re.search(r"ctc dev after 8 steps: wer [0-9.]+ \(empty transcript 1.0000\)", out), out
    assert json.loads((workdir / "config.json").read_text())["method"] == "ctc_cpc"


# --- From HuBERT: method ctc_hubert ----------------------------------------------------------

def _hubert_ctc_config():
    from test_hubert import HEAD
    from test_hubert import TINY as HUBERT_TINY

    from pretext_jax.models.hubert import HubertCTCConfig

    body = {k: v for k, v in dataclasses.asdict(HUBERT_TINY).items() if k not in HEAD}
    return HubertCTCConfig(**body, vocab_size=VOCAB, blank_id=0, quantizer_input_dropout=0.0)


# rtol 3e-7: the summed loss (~108) is up to three float32 units in the last place from HF's
# (2.3e-5); the logits and the mean loss meet the absolute 1e-5 alone.
HUBERT_PARITY = Parity("HubertForCTC", hf_ctc_padded_logits, our_ctc, rtol=3e-7)


@pytest.mark.usefixtures("deterministic_torch")
@pytest.mark.parametrize("layout", ["base", "no_projection_norm"])
def test_parity_with_hf_hubert_for_ctc_and_round_trip(tmp_path, layout):
    """A HF `HubertForCTC` loads as `HubertForCTC` without a warning, logits on real frames
    and the mean and summed CTC losses within 1e-5 on a padded batch (with and without the
    feature projection's LayerNorm); ours exported is a complete `HubertForCTC` to transformers
    computing the same, and reads back as itself; wav2vec 2.0's CTC weights are a negative
    control."""
    transformers = pytest.importorskip("transformers")
    from parity_utils import hf_reference
    from test_hubert import HF_HUBERT_TINY, LAYOUTS

    from pretext_jax.models.hubert import HubertForCTC

    hf_reference("HubertForCTC", 2, **HF_HUBERT_TINY, **LAYOUTS[layout], vocab_size=VOCAB,
                 pad_token_id=0, ctc_loss_reduction="mean").save_pretrained(tmp_path / "hf")
    reference = transformers.HubertForCTC.from_pretrained(tmp_path / "hf").eval()
    ours = converted(reference, tmp_path / "again", **CTC_NO_DROPOUT)
    assert type(ours) is HubertForCTC and ours.config.vocab_size == VOCAB
    assert (ours.feature_layer_norm is None) == (layout == "no_projection_norm")
    HUBERT_PARITY.assert_parity(ours, reference, *ctc_inputs(0), atol=1e-5)
    other = random_model(Wav2Vec2ForCTC, TINY_CTC, 3)
    with pytest.raises(AssertionError):
        PARITY.assert_parity(other, reference, *ctc_inputs(0), atol=1e-5)
    config = dataclasses.replace(_hubert_ctc_config(),
                                 feature_projection_layer_norm=layout == "base")
    _, saved = HUBERT_PARITY.round_trip(random_model(HubertForCTC, config, 3), tmp_path / "out",
                                        *ctc_inputs(1), **CTC_NO_DROPOUT)
    assert saved["model_type"] == "hubert" and saved["vocab_size"] == VOCAB
    assert saved["feat_proj_layer_norm"] == (layout == "base")


def test_finetune_from_a_hubert_run_chooses_ctc_hubert_with_fairseqs_recipe(transcribed,
                                                                            tmp_path, capsys):
    """A pretext hubert model directory on task ctc: method `ctc_hubert`, every value of the
    `ctc_hubert_base_10h` preset (fairseq's HuBERT base_10h.yaml) and the body's sizes; the
    body arrives parameter for parameter under a new output layer; the CLI run trains to a
    finite loss and reports WER, and exports as HF `HubertForCTC`. A wav2vec 2.0 stays `ctc`'s
    (the control)."""
    from flax import nnx
    from test_hubert import TINY as HUBERT_TINY

    import run
    from pretext_jax.models.hubert import Hubert, HubertForCTC
    from pretext_jax.objectives import ctc, registry
    from pretext_jax.pretrain.export import save_model
    from pretext_jax.pretrain.finetune import finetune_config

    hubert = random_model(Hubert, dataclasses.replace(HUBERT_TINY,
                                                      feature_projection_layer_norm=False), 7)
    init = str(save_model(hubert, "hubert", tmp_path / "hubert"))
    data = f"{transcribed / 'train.tsv'},{transcribed / 'dev.tsv'}"
    config = finetune_config("ctc", init, data)
    assert config.method == "ctc_hubert"
    preset = registry.preset(ctc.HUBERT_RECIPE_PRESET)
    assert preset.pop("method") == "ctc_hubert"
    for section, values in preset.items():
        for key, value in values.items():
            assert getattr(getattr(config, section), key) == value, (section, key)
    o = config.optim  # base_10h.yaml: 25,000 updates at 2e-5, 8,000 warmup, mask_prob 0.75
    assert (config.train.steps, o.learning_rate, o.warmup_steps, o.hold_steps) == (
        25000, 2e-5, 8000, 0)
    assert config.objective.mask_start_fraction * 10 == 0.75
    assert (config.objective.freeze_updates, config.model.layerdrop) == (10000, 0.1)
    # fairseq's decay: 0.05 x lr after 72,000 updates, stopped after 17,000 of them.
    assert o.end_learning_rate == pytest.approx(2e-5 * 0.05 ** (17000 / 72000), rel=1e-12)
    assert (config.model.hidden_size, config.model.feature_projection_layer_norm) == (32, False)
    assert finetune_config("ctc", init, data, recipe=ctc.HUBERT_RECIPE_PRESET) == config
    with pytest.raises(UserError, match="--recipe ctc_base_10h: .*ctc_hubert_base_10h"):
        finetune_config("ctc", init, data, recipe="ctc_base_10h")
    model = ctc.pretrained_ctc(dataclasses.replace(config.model, vocab_size=VOCAB), 0,
                               lambda path: hubert)
    assert type(model) is HubertForCTC and model.feature_layer_norm is None
    theirs = dict(nnx.to_flat_state(nnx.state(hubert, nnx.Param)))
    ours = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    body = [path for path in ours if path[0] != "lm_head"]
    assert set(theirs) - set(body) == {("final_proj", "kernel"), ("final_proj", "bias"),
                                       ("label_embeddings",)}
    for path in body:
        np.testing.assert_array_equal(np.asarray(ours[path].get_value()),
                                      np.asarray(theirs[path].get_value()), err_msg=str(path))
    w2v = finetune_config("ctc", str(transcribed / "w2v"), data)
    assert w2v.method == "ctc" and w2v.train.steps == 20000
    fast = ["train.batch_size=8", "train.progress=false", "optim.warmup_steps=1",
            "objective.freeze_updates=2", "examples.max_samples=3200",
            "optim.learning_rate=1e-3", "objective.channel_mask_fraction=0.1",
            "objective.channel_mask_span=4"]
    workdir = tmp_path / "run"
    assert run.main(["finetune", "--task", "ctc", "--init", init, "--data", data,
                     "--workdir", str(workdir), "--epochs", "2", *fast]) == 0
    out = capsys.readouterr().out
    assert re.search(r"ctc dev after 4 steps: wer [0-9.]+ \(empty transcript 1.0000\)", out), out
    result = json.loads((workdir / "results.json").read_text())
    assert all(np.isfinite(v) for v in result["dev"].values())
    assert json.loads((workdir / "config.json").read_text())["method"] == "ctc_hubert"
    from resilience_utils import train_losses

    losses = train_losses(workdir)
    assert losses and all(np.isfinite(loss) for loss in losses.values())
    assert run.main(["convert", str(workdir), str(tmp_path / "hf"), "--to", "hf"]) == 0
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert saved["architectures"] == ["HubertForCTC"] and not saved["feat_proj_layer_norm"]
