"""RoBERTa: parity with HF `RobertaForMaskedLM` (padding positions included), the HF round trip,
RoBERTa's position ids, FULL-SENTENCES packing, dynamic masking, and training through the
Trainer on a mixed mesh."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity_utils import (
    MASKED_POSITIONS,
    Parity,
    assert_gathered,
    converted,
    padded_inputs,
    random_model,
)

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples.bert import MaskingVocab
from pretext_jax.input_pipeline.examples.roberta import (
    RobertaExampleConfig,
    create_training_examples,
    pack_full_sentences,
)
from pretext_jax.models.encoder import padded_position_ids
from pretext_jax.models.roberta import Roberta, RobertaConfig
from pretext_jax.objectives.roberta import prepare_roberta

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# HF RobertaConfig fields: the released layout (pad 1, one token type), then pad 0 with the
# tanh GELU in the layers (HF's LM head keeps the exact GELU) and other epsilons.
CONFIGS = [
    dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
         intermediate_size=37, max_position_embeddings=40, type_vocab_size=1, pad_token_id=1),
    dict(vocab_size=64, hidden_size=24, num_hidden_layers=3, num_attention_heads=2,
         intermediate_size=40, max_position_embeddings=30, type_vocab_size=1, pad_token_id=0,
         hidden_act="gelu_new", layer_norm_eps=1e-7),
]


def roberta_batch(vocab_size: int, pad: int, seed: int):
    """[3, 17] ids padded with the padding id where the mask is 0 (and nowhere else)."""
    ids, _, mask = padded_inputs(vocab_size, 1, seed)
    ids = np.where(ids == pad, pad + 1, ids)
    return np.where(mask == 1, ids, pad), mask


def hf_outputs(model, ids, mask):
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    return {"hidden_states": out.hidden_states[-1], "mlm_logits": out.logits}


def our_outputs(model, ids, mask):
    out = model(ids, None, mask)
    return {"hidden_states": out.hidden_states, "mlm_logits": out.mlm_logits}


# Every position is compared, padding included (HF gives pads the padding position, as we do).
ROBERTA = Parity("RobertaForMaskedLM", hf_outputs, our_outputs)


@pytest.mark.usefixtures("deterministic_torch")
@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_parity_with_hf_roberta_for_masked_lm(index, tmp_path):
    config = CONFIGS[index]
    reference = ROBERTA.reference(index, **config)
    model = converted(reference, tmp_path)
    assert isinstance(model, Roberta)
    assert model.config.position_padding_id == config["pad_token_id"]
    ids, mask = roberta_batch(config["vocab_size"], config["pad_token_id"], index)
    expected = ROBERTA.assert_parity(model, reference, ids, mask)
    gathered = model(jnp.asarray(ids), None, jnp.asarray(mask),
                     masked_positions=jnp.asarray(MASKED_POSITIONS)).mlm_logits
    assert_gathered(gathered, expected["mlm_logits"])


@pytest.mark.usefixtures("deterministic_torch")
def test_our_model_round_trips_through_transformers(tmp_path):
    config = RobertaConfig(vocab_size=50, hidden_size=24, num_layers=2, num_heads=3,
                           intermediate_size=40, max_position_embeddings=24,
                           position_padding_id=1, layer_norm_eps=1e-6, hidden_dropout=0.2)
    ours = random_model(Roberta, config, 0)
    _, hf_config = ROBERTA.round_trip(ours, tmp_path / "exported", *roberta_batch(50, 1, 4))
    assert hf_config["pad_token_id"] == 1 and hf_config["type_vocab_size"] == 1


def test_position_ids_count_non_padding_tokens():
    ids = np.array([[7, 8, 9, 1, 1], [5, 1, 6, 1, 7]])
    expected = [[2, 3, 4, 1, 1], [2, 1, 3, 1, 4]]  # pad 1: positions from 2, pads at 1
    np.testing.assert_array_equal(padded_position_ids(jnp.asarray(ids), 1), expected)
    np.testing.assert_array_equal(padded_position_ids(jnp.asarray(ids), 1),
                                  transformers.models.roberta.modeling_roberta.RobertaEmbeddings
                                  .create_position_ids_from_input_ids(torch.tensor(ids), 1))
    # A position table too short for pad + T is refused instead of read out of range.
    model = nnx.eval_shape(lambda: Roberta(RobertaConfig(
        vocab_size=20, hidden_size=8, num_layers=1, num_heads=2, intermediate_size=8,
        max_position_embeddings=6, position_padding_id=1), rngs=nnx.Rngs(0)))
    with pytest.raises(UserError, match="need 7 RoBERTa positions"):
        model(jnp.ones((1, 5), jnp.int32))


# --- FULL-SENTENCES packing -------------------------------------------------------------------

VOCAB = MaskingVocab(2000, 0, 2, 3, 4, np.zeros(2000, bool))


def traceable_documents(seed: int = 0) -> list[list[list[int]]]:
    """Documents whose tokens are all distinct (ids from 5 up), so every token can be traced;
    some sentences are longer than a block."""
    rng = np.random.default_rng(seed)
    next_id, documents = 5, []
    for _ in range(40):
        document = []
        for _ in range(rng.integers(1, 6)):
            length = int(rng.choice([rng.integers(1, 12), 40]) if rng.random() < 0.1
                         else rng.integers(1, 12))
            document.append(list(range(next_id, next_id + length)))
            next_id += length
        documents.append(document)
    return documents


def test_full_sentence_blocks_cross_documents_and_use_every_token_once():
    documents, capacity, sep = traceable_documents(), 30, VOCAB.sep_id
    blocks = list(pack_full_sentences(documents, capacity, sep))
    stream = [t for document in documents for sentence in document for t in sentence]
    assert all(0 < len(block) <= capacity for block in blocks)
    assert [t for block in blocks for t in block if t != sep] == stream  # once each, in order
    assert all(block[0] != sep and block[-1] != sep for block in blocks)
    document_of = {t: d for d, document in enumerate(documents) for s in document for t in s}
    crossing = 0
    for block in blocks:
        for left, right in zip(block, block[1:], strict=False):
            if sep not in (left, right):  # neighbours without a separator: one document
                assert document_of[left] == document_of[right]
        for i, token in enumerate(block):
            if token == sep:  # a separator stands exactly between two documents
                assert document_of[block[i + 1]] == document_of[block[i - 1]] + 1
                crossing += 1
    assert crossing > 10  # blocks do cross documents
    # Sentences stay whole unless longer than a block, and a block is closed only when the
    # next sentence (with its separator) does not fit.
    location = {t: b for b, block in enumerate(blocks) for t in block if t != sep}
    for document in documents:
        for sentence in document:
            if len(sentence) <= capacity:
                assert len({location[t] for t in sentence}) == 1
    for block, following in zip(blocks, blocks[1:], strict=False):
        first = following[0]
        sentence = next(s for d in documents for s in d if first in s)
        if sentence[0] != first:  # the rest of a cut sentence: the block before it was full
            assert len(block) == capacity
            continue
        separator = int(document_of[first] != document_of[block[-1]])
        assert len(block) + separator + min(len(sentence), capacity) > capacity


def test_records_are_single_segment_and_masked_anew_on_every_load(tmp_path):
    config = RobertaExampleConfig(max_seq_length=32, max_predictions_per_seq=5)
    documents = traceable_documents(1)
    records = list(create_training_examples(documents, VOCAB, config, seed=0))
    stream = sorted(t for d in documents for s in d for t in s)
    tokens = []
    for record in records:
        length = int(record["input_mask"].sum())
        ids = record["input_ids"]
        assert ids[0] == VOCAB.cls_id and ids[length - 1] == VOCAB.sep_id
        assert (ids[length:] == VOCAB.pad_id).all() and not record["segment_ids"].any()
        assert set(record) == {"input_ids", "input_mask", "segment_ids"}
        tokens += [t for t in ids[1:length - 1] if t != VOCAB.sep_id]
    assert sorted(tokens) == stream  # documents shuffled, every token still used once
    # Dynamic masking (§4.1): the same record gets other masks on other loads.
    from pretext_jax.input_pipeline.examples.bert import DynamicMasking

    masking = DynamicMasking(VOCAB, config)
    record = max(records, key=lambda r: r["input_mask"].sum())
    draws = [masking.random_map(record, np.random.default_rng(s)) for s in range(20)]
    assert len({tuple(d["masked_lm_positions"]) for d in draws}) > 10
    for draw in draws:
        assert draw["masked_lm_weights"].sum() == 5
        original = record["input_ids"][draw["masked_lm_positions"]]
        assert not np.isin(original, [VOCAB.cls_id, VOCAB.sep_id, VOCAB.pad_id]).any()


def test_config_errors():
    from pretext_jax.objectives.roberta import check_roberta

    with pytest.raises(UserError, match="max_position_embeddings >= 130"):
        check_roberta(RobertaConfig(max_position_embeddings=128), RobertaExampleConfig(
            max_seq_length=128))
    with pytest.raises(UserError, match="masked_lm_prob"):
        RobertaExampleConfig(masked_lm_prob=0.0)


def test_tiny_roberta_trains_through_the_trainer_on_a_mixed_mesh(tmp_path):
    from pretext_jax.pretrain.config import make_config
    from pretext_jax.pretrain.trainer import Trainer

    overrides = {"model.hidden_size": 32, "model.num_heads": 2, "model.intermediate_size": 64,
                 "examples.max_seq_length": 32, "examples.max_predictions_per_seq": 5,
                 "data.vocab_size": 1000, "data.cache_dir": str(tmp_path / "cache"),
                 "train.steps": 80, "train.batch_size": 32, "train.log_every": 5,
                 "train.eval_every": 80, "train.eval_batches": 2, "train.progress": False,
                 "train.checkpoint_every": 1000, "optim.warmup_steps": 10,
                 "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}
    trainer = Trainer(make_config("roberta_tiny", overrides), tmp_path / "w")
    assert trainer.model_config.position_padding_id == 0  # from the tokenizer
    prepared = prepare_roberta(trainer.config.data, trainer.example_config,
                               tmp_path / "cache", 0)  # cached: the trainer's records
    records = prepared.train.examples(range(len(prepared.train)))
    lengths = records["input_mask"].sum(axis=1)
    assert lengths.max() <= 32 and lengths.mean() > 20  # several sentences per input
    inner = records["input_ids"][:, 1:-1][records["input_mask"][:, 2:] == 1]
    assert (inner == 3).sum() > 20, (inner == 3).sum()  # [SEP] between documents inside inputs
    summary = trainer.run()
    rows = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").open()]
    train = [r["mlm_loss"] for r in rows if r["split"] == "train"]
    assert len(train) == 16 and np.isfinite(train).all()
    # From ~ln(1000) = 6.9 (uniform) down by far more than the step-to-step noise (~0.1).
    assert np.mean(train[:2]) - np.mean(train[-3:]) > 0.7, train
    assert summary["eval"]["mlm_loss"] < np.log(1000) - 0.7
