"""UniLM (Dong et al. 2019): the four self-attention masks against their definition, outputs
blind to the tokens a mask hides, the objectives' rates, the masking policy, the loss's
positions, and training (CLI with falling held-out loss, one step equal on every mesh, exact
resume after a kill). The encoder is BERT's, whose HF parity tests/test_bert_parity.py
covers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from resilience_utils import (
    GRADIENT_STEP,
    TINY_BERT,
    abort_and_resume,
    assert_same_step_on_every_mesh,
    assert_same_training,
    mesh_overrides,
    run_in_process,
    small_corpus,
)

from pretext_jax import run
from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples.albert import choose_ngram_spans
from pretext_jax.input_pipeline.examples.bert import MaskingVocab, prediction_budget
from pretext_jax.input_pipeline.examples.unilm import (
    BIDIRECTIONAL,
    LEFT_TO_RIGHT,
    OBJECTIVE_RATES,
    RIGHT_TO_LEFT,
    SEQ2SEQ,
    UnilmExampleConfig,
    create_training_examples,
)
from pretext_jax.models.bert import Bert
from pretext_jax.models.encoder import EncoderConfig
from pretext_jax.objectives.unilm import (
    UnilmConfig,
    attention_masks,
    check_unilm,
    pretrained_unilm,
    unilm_loss,
)
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.loading import load_model, load_pretrained
from pretext_jax.pretrain.trainer import Trainer

VOCAB = MaskingVocab(100, 0, 2, 3, 4, np.zeros(100, bool))  # pad 0, [CLS] 2, [SEP] 3, [MASK] 4
T = 12
# (objective, length of the first segment incl. [CLS] and its [SEP], length of the second)
LAYOUTS = [(BIDIRECTIONAL, 4, 5), (SEQ2SEQ, 5, 3), (LEFT_TO_RIGHT, 7, 0),
           (RIGHT_TO_LEFT, 6, 0), (SEQ2SEQ, 3, 9), (BIDIRECTIONAL, 6, 6)]
TYPES = {BIDIRECTIONAL: (0, 1), SEQ2SEQ: (4, 5), LEFT_TO_RIGHT: (2, 2), RIGHT_TO_LEFT: (3, 3)}


def layout_batch(seed: int = 0) -> dict[str, np.ndarray]:
    """`LAYOUTS` as padded rows of random ids with their token types."""
    rng = np.random.default_rng(seed)
    batch = {k: np.zeros((len(LAYOUTS), T), np.int32)
             for k in ("input_ids", "segment_ids", "input_mask")}
    batch["objective"] = np.array([o for o, _, _ in LAYOUTS], np.int32)
    for b, (objective, first, second) in enumerate(LAYOUTS):
        batch["input_ids"][b, :first + second] = rng.integers(5, 100, first + second)
        batch["segment_ids"][b, :first] = TYPES[objective][0]
        batch["segment_ids"][b, first:first + second] = TYPES[objective][1]
        batch["input_mask"][b, :first + second] = 1
    return batch


def definition(objective: int, first: int, second: int) -> np.ndarray:
    """The mask of Fig. 1 / §2.2, entry by entry: 1 = query i may attend to key j."""
    length = first + second
    mask = np.zeros((T, T), bool)
    for i in range(T):
        for j in range(length):
            # a padding query (whose output nothing reads) sees every token
            if i >= length or objective == BIDIRECTIONAL:
                mask[i, j] = True
            elif objective == LEFT_TO_RIGHT:
                mask[i, j] = j <= i
            elif objective == RIGHT_TO_LEFT:
                mask[i, j] = j >= i
            else:  # source sees the source; target sees the source and its own left part
                mask[i, j] = j < first or (i >= first and j <= i)
    return mask


def test_masks_equal_their_definition():
    batch = layout_batch()
    masks = np.asarray(attention_masks(*(jnp.asarray(batch[k]) for k in
                                         ("objective", "segment_ids", "input_mask"))))
    assert masks.shape == (len(LAYOUTS), T, T) and masks.dtype == bool
    for b, layout in enumerate(LAYOUTS):
        np.testing.assert_array_equal(masks[b], definition(*layout), err_msg=str(layout))


def tiny_bert(dropout: float = 0.0) -> Bert:
    config = EncoderConfig(vocab_size=100, hidden_size=32, num_layers=2, num_heads=4,
                           intermediate_size=64, max_position_embeddings=T, type_vocab_size=6,
                           hidden_dropout=dropout, attention_dropout=dropout,
                           dtype="float32")
    with nnx.use_eager_sharding(False):
        return Bert(config, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_outputs_ignore_the_tokens_their_mask_hides(dropout):
    """For every query of every example, changing all the tokens it may not see leaves its
    output unchanged, while changing one token it sees changes it (also on the dropout path:
    the same rng and batch shape give the same dropout masks). One row per case, all in one
    call. Without dropout, bidirectional rows also equal the plain key-mask call."""
    model = tiny_bert(dropout)
    rng = jax.random.key(1) if dropout else None
    batch = layout_batch()
    fields = ("objective", "segment_ids", "input_mask")

    @nnx.jit
    def forward(model, ids, segment_ids, mask, rng):
        return model(ids, segment_ids, mask, rng=rng).hidden_states

    def hidden(ids, segment_ids, mask):
        return forward(model, jnp.asarray(ids), jnp.asarray(segment_ids), mask, rng)

    if not dropout:
        masks = attention_masks(*(jnp.asarray(batch[k]) for k in fields))
        bidirectional = batch["objective"] == BIDIRECTIONAL
        np.testing.assert_allclose(
            np.asarray(hidden(batch["input_ids"], batch["segment_ids"], masks))[bidirectional],
            np.asarray(hidden(batch["input_ids"], batch["segment_ids"],
                              jnp.asarray(batch["input_mask"])))[bidirectional], atol=1e-6)
    cases, hidden_ids, seen_ids = [], [], []
    for b, layout in enumerate(LAYOUTS):
        allowed = definition(*layout)
        for i in range(layout[1] + layout[2]):
            ids = batch["input_ids"][b].copy()
            ids[~allowed[i]] = (ids[~allowed[i]] + 7) % 95 + 5
            hidden_ids.append(ids)
            seen = [j for j in np.flatnonzero(allowed[i]) if j != i] or [i]
            ids = batch["input_ids"][b].copy()
            ids[seen[0]] = ids[seen[0]] % 95 + 6
            seen_ids.append(ids)
            cases.append((b, i))
    rows = np.array([b for b, _ in cases])
    queries = np.array([i for _, i in cases])
    rows_batch = {k: batch[k][rows] for k in fields}
    row_masks = attention_masks(*(jnp.asarray(rows_batch[k]) for k in fields))
    outputs = [np.asarray(hidden(np.stack(ids) if isinstance(ids, list) else ids,
                                 rows_batch["segment_ids"], row_masks))[np.arange(len(rows)),
                                                                         queries]
               for ids in (batch["input_ids"][rows], hidden_ids, seen_ids)]
    base, after_hidden, after_seen = outputs
    np.testing.assert_allclose(after_hidden, base, atol=1e-5)
    assert (np.abs(after_seen - base).max(axis=1) > 1e-4).all()


def synthetic_documents(count: int, seed: int) -> list[list[list[int]]]:
    rng = np.random.default_rng(seed)
    return [[rng.integers(5, 100, rng.integers(3, 12)).tolist()
             for _ in range(rng.integers(1, 8))] for _ in range(count)]


CONFIG = UnilmExampleConfig(max_seq_length=32, max_predictions_per_seq=8, dupe_factor=2)


@pytest.fixture(scope="module")
def records() -> list[dict[str, np.ndarray]]:
    return list(create_training_examples(synthetic_documents(1500, 0), VOCAB, CONFIG, 0))


def test_objectives_follow_the_papers_rates_and_the_seed(records):
    objectives = np.array([r["objective"] for r in records])
    n = len(objectives)
    assert n > 3000
    rates = np.bincount(objectives, minlength=4) / n
    tolerance = 4 * np.sqrt(OBJECTIVE_RATES * (1 - OBJECTIVE_RATES) / n)  # 4 sigma
    assert (np.abs(rates - OBJECTIVE_RATES) < tolerance).all(), rates
    again = list(create_training_examples(synthetic_documents(1500, 0), VOCAB, CONFIG, 0))
    assert all(a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
               for a, b in zip(records, again, strict=True))
    other = create_training_examples(synthetic_documents(1500, 0), VOCAB, CONFIG, 1)
    assert [int(r["objective"]) for r in other][:50] != objectives[:50].tolist()


def test_layouts_and_masking_policy(records):
    """Pairs [CLS] A [SEP] B [SEP] for the bidirectional and seq2seq objectives, one segment
    for the unidirectional ones, token types per objective; masks within BERT's budget, never
    on [CLS]/[SEP]/padding, in both segments, 80/10/10, NSP labels only where B may be random."""
    replaced = {"mask": 0, "kept": 0, "other": 0}
    in_second = {BIDIRECTIONAL: 0, SEQ2SEQ: 0}
    for r in records:
        objective, length = int(r["objective"]), int(r["input_mask"].sum())
        ids, types = r["input_ids"][:length], r["segment_ids"][:length]
        first, second = TYPES[objective]
        assert ids[0] == VOCAB.cls_id and ids[-1] == VOCAB.sep_id
        count = int(r["masked_lm_weights"].sum())
        positions = r["masked_lm_positions"][:count]
        assert 1 <= count <= prediction_budget(length, CONFIG)
        assert len(set(positions.tolist())) == count and (positions > 0).all()
        assert (positions < length - 1).all()
        labels = r["masked_lm_ids"][:count]
        assert not np.isin(labels, [VOCAB.cls_id, VOCAB.sep_id, VOCAB.pad_id]).any()
        at = ids[positions]
        replaced["mask"] += int((at == VOCAB.mask_id).sum())
        replaced["kept"] += int((at == labels).sum())
        replaced["other"] += int(((at != VOCAB.mask_id) & (at != labels)).sum())
        unmasked = np.setdiff1d(np.arange(length), positions)
        assert not (ids[unmasked] == VOCAB.mask_id).any()
        separators = unmasked[ids[unmasked] == VOCAB.sep_id]
        if objective in (LEFT_TO_RIGHT, RIGHT_TO_LEFT):
            assert (types == first).all() and int(r["next_sentence_labels"]) == 0
            assert separators.tolist() == [length - 1]
        else:
            boundary = int((types == first).sum())
            assert (types[:boundary] == first).all() and (types[boundary:] == second).all()
            assert separators.tolist() == [boundary - 1, length - 1]
            in_second[objective] += int((positions >= boundary).sum())
            if objective == SEQ2SEQ:
                assert int(r["next_sentence_labels"]) == 0
        assert (r["segment_ids"][length:] == 0).all() and (r["input_ids"][length:] == 0).all()
    total = sum(replaced.values())
    assert abs(replaced["mask"] / total - 0.8) < 0.02, replaced
    assert abs(replaced["kept"] / total - 0.1) < 0.02, replaced  # + 1% random hits
    assert all(value > 200 for value in in_second.values()), in_second
    nsp = np.array([int(r["next_sentence_labels"]) for r in records
                    if r["objective"] == BIDIRECTIONAL])
    assert 0.4 < nsp.mean() < 0.75, nsp.mean()  # 0.5, plus one-sentence chunks (always random)


def test_spans_are_one_token_80_percent_of_the_time():
    """p(n) = 0.8, 0.1, 0.1 for n = 1, 2, 3 (§2.3; unilm-v1 skipgram_prb 0.2, size 3)."""
    probabilities = UnilmExampleConfig().span_probabilities
    np.testing.assert_allclose(probabilities, [0.8, 0.1, 0.1])
    candidates = [[i] for i in range(1, 60)]
    rng = np.random.default_rng(0)
    lengths = [len(choose_ngram_spans(candidates, 6, probabilities, rng)[0])
               for _ in range(4000)]
    np.testing.assert_allclose(np.bincount(lengths, minlength=4)[1:] / 4000, [0.8, 0.1, 0.1],
                               atol=0.03)


def test_loss_reads_the_masked_positions_and_nsp_only_on_bidirectional_rows():
    model = tiny_bert()
    batch = layout_batch()
    rng = np.random.default_rng(3)
    batch["masked_lm_positions"] = np.stack([rng.choice(layout[1] + layout[2], 3, replace=False)
                                             for layout in LAYOUTS]).astype(np.int32)
    batch["masked_lm_ids"] = rng.integers(5, 100, (len(LAYOUTS), 3)).astype(np.int32)
    batch["masked_lm_weights"] = np.ones((len(LAYOUTS), 3), np.float32)
    batch["masked_lm_weights"][0, 2] = 0.0
    batch["next_sentence_labels"] = np.array([1, 0, 1, 0, 1, 0], np.int32)
    jbatch = {k: jnp.asarray(v) for k, v in batch.items()}
    loss, metrics = unilm_loss(model, jbatch, None)
    masks = attention_masks(jbatch["objective"], jbatch["segment_ids"], jbatch["input_mask"])
    out = model(jbatch["input_ids"], jbatch["segment_ids"], masks)
    every_position = model.lm_head(out.hidden_states, model.encoder.embeddings.word_embeddings)
    log_probs = jax.nn.log_softmax(every_position, axis=-1)  # [B, T, V]; gathered below
    nll = -np.take_along_axis(np.take_along_axis(
        np.asarray(log_probs), batch["masked_lm_positions"][..., None], 1),
        batch["masked_lm_ids"][..., None], 2)[..., 0]
    weights = batch["masked_lm_weights"]
    mlm = (weights * nll).sum() / (weights.sum() + 1e-5)
    nsp_log = np.asarray(jax.nn.log_softmax(out.nsp_logits, axis=-1))
    rows = np.flatnonzero(batch["objective"] == BIDIRECTIONAL)
    nsp = -nsp_log[rows, batch["next_sentence_labels"][rows]].mean()
    assert float(loss) == pytest.approx(mlm + nsp, rel=1e-5)
    per_objective = metrics["mlm_loss_seq2seq"]
    rows = batch["objective"] == SEQ2SEQ
    assert float(per_objective[0] / per_objective[1]) == pytest.approx(
        (weights[rows] * nll[rows]).sum() / weights[rows].sum(), rel=1e-5)
    flipped = dict(jbatch, next_sentence_labels=jbatch["next_sentence_labels"].at[1:5].set(
        1 - jbatch["next_sentence_labels"][1:5]))  # no bidirectional row among 1..4
    assert float(unilm_loss(model, flipped, None)[0]) == float(loss)
    flipped = dict(jbatch, next_sentence_labels=jbatch["next_sentence_labels"].at[0].set(0))
    assert float(unilm_loss(model, flipped, None)[0]) != pytest.approx(float(loss), rel=1e-6)


def test_config_errors():
    with pytest.raises(UserError, match="type_vocab_size=6"):
        check_unilm(EncoderConfig(type_vocab_size=2), UnilmExampleConfig())
    with pytest.raises(UserError, match="dynamic_masking"):
        UnilmExampleConfig(dynamic_masking=True)
    with pytest.raises(UserError, match="max_ngram"):
        UnilmExampleConfig(max_ngram=1)


def sst2_folder(root: Path) -> Path:
    """A tiny GLUE folder: SST-2 train/dev of filler sentences, label 1 with "more"."""
    rng = np.random.default_rng(0)
    words = ["sentence", "talks", "about", "topic", "and", "then", "some", "words"]
    (root / "SST-2").mkdir(parents=True)
    for split, count in (("train", 64), ("dev", 32)):
        labels = rng.integers(0, 2, count)
        rows = [" ".join([*rng.choice(words, 5), "more" if y else "some"]) + f"\t{y}"
                for y in labels]
        (root / "SST-2" / f"{split}.tsv").write_text("sentence\tlabel\n" + "\n".join(rows))
    return root


def test_cli_trains_unilm_tiny_with_falling_held_out_loss(tmp_path):
    """Pre-training from the CLI, then GLUE fine-tuning of its encoder through the existing
    classifier (GLUE's token types 0/1 are UniLM's bidirectional ones)."""
    corpus = small_corpus(tmp_path)
    settings = {**TINY_BERT, **corpus, "train.steps": 60, "train.batch_size": 32,
                "train.log_every": 15, "train.eval_every": 15, "train.eval_batches": 2,
                "train.checkpoint_every": 1000, "optim.learning_rate": 2e-3,
                "optim.warmup_steps": 5}
    assert run.main(["pretrain", "--preset", "unilm_tiny", "--workdir", str(tmp_path / "w"),
                     *[f"{k}={v}" for k, v in settings.items()]]) == 0
    rows = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").open()]
    held_out = [r for r in rows if r["split"] == "eval"]
    assert [r["step"] for r in held_out] == [15, 30, 45, 60]
    losses = [r["mlm_loss"] for r in held_out]  # from ~ln(60) = 4.1 (uniform)
    assert losses[-1] < losses[0] - 0.25 and losses[-1] == min(losses), losses
    assert all(np.isfinite(r[f"mlm_loss_{name}"]) for r in held_out
               for name in ("bidirectional", "seq2seq", "left_to_right", "right_to_left"))
    assert run.main(["finetune", "--task", "sst2", "--init", str(tmp_path / "w"), "--data",
                     str(sst2_folder(tmp_path / "glue")), "--workdir", str(tmp_path / "ft"),
                     "examples.max_seq_length=16", "train.batch_size=16",
                     "train.progress=false", "train.steps=2"]) == 0
    classifier = load_model(tmp_path / "ft")
    assert classifier.encoder.embeddings.token_type_embeddings.embedding.shape[0] == 6


def test_same_step_on_every_mesh(tmp_path):
    """One plain gradient step gives the same loss and parameters on one device and on (8,1,1)
    and (2,2,2) meshes, on a batch that mixes the objectives."""
    base = {**TINY_BERT, **small_corpus(tmp_path), **GRADIENT_STEP, "train.steps": 1}

    def trainer_at(workdir, mesh, devices):
        return Trainer(make_config("unilm_tiny", {**base, **mesh_overrides(mesh)}), workdir,
                       devices=devices)

    batch = assert_same_step_on_every_mesh(trainer_at, tmp_path)
    assert len(set(batch["objective"].tolist())) >= 3


def test_killed_run_resumes_bit_for_bit(tmp_path):
    overrides = {**TINY_BERT, **small_corpus(tmp_path)}
    reference = tmp_path / "reference", tmp_path / "reference.log"
    run_in_process("unilm_tiny", overrides, *reference)
    ours = abort_and_resume("unilm_tiny", overrides, tmp_path, step=5)
    executed = assert_same_training("unilm_tiny", overrides, ours, reference)
    assert len(executed) > 8


def test_unilm_continues_from_an_hf_bert_with_unilm_v1s_token_types(tmp_path):
    """`model.init` = an HF BertForPreTraining folder (§2.3: UniLM starts from BERT-Large):
    every weight is the BERT's, its two token-type rows widened to six as unilm-v1's
    `from_pretrained` does (2, 3, 4 <- 0; 5 <- 1), so the network computes the BERT's function
    for token types 0 and 1, and type 4 is type 0. A differing architecture or a missing
    folder is a one-line error naming the fix."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    reference = transformers.BertForPreTraining(transformers.BertConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=64, type_vocab_size=2))
    reference.save_pretrained(tmp_path / "bert")
    bert = load_pretrained(tmp_path / "bert")
    config = UnilmConfig(**{**dataclasses.asdict(bert.config), "type_vocab_size": 6,
                            "init": str(tmp_path / "bert")})
    model = pretrained_unilm(config, 0, load_pretrained)
    rows = reference.bert.embeddings.token_type_embeddings.weight.detach().numpy()
    np.testing.assert_array_equal(model.encoder.embeddings.token_type_embeddings.embedding[...],
                                  rows[[0, 1, 0, 0, 0, 1]])
    theirs = dict(nnx.to_flat_state(nnx.state(bert, nnx.Param)))
    for key, value in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if "token_type_embeddings" not in key:
            np.testing.assert_array_equal(value[...], theirs[key][...])
    ids = jnp.asarray(np.random.default_rng(0).integers(5, 99, (2, 10)))
    types = jnp.asarray(np.repeat([[0] * 5 + [1] * 5], 2, axis=0))
    mask = jnp.ones_like(ids)
    np.testing.assert_allclose(model(ids, types, mask).hidden_states,
                               bert(ids, types, mask).hidden_states, atol=1e-6)
    np.testing.assert_allclose(model(ids, jnp.where(types == 0, 4, 5), mask).hidden_states,
                               bert(ids, types, mask).hidden_states, atol=1e-6)
    assert pretrained_unilm(dataclasses.replace(config, init=""), 0, load_pretrained) is None
    with pytest.raises(UserError, match="model.hidden_size=48 differs .* set model.hidden_size=32"):
        pretrained_unilm(dataclasses.replace(config, hidden_size=48), 0, load_pretrained)
    with pytest.raises(UserError, match="not a directory; download"):
        pretrained_unilm(dataclasses.replace(config, init=str(tmp_path / "none")), 0,
                         load_pretrained)
    large = make_config("unilm_large")
    assert (large.model.num_layers, large.model.hidden_size, large.model.init,
            large.optim.learning_rate, large.optim.warmup_steps) == (
        24, 1024, "bert-large-cased", 3e-5, 40000)
