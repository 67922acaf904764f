"""XLNet's beam SQuAD head (`models.span.BeamSpanExtractor`, zihangdai/xlnet run_squad.py):
parity of its training loss and beam outputs with HF `XLNetForQuestionAnswering` (import and
export), the authors' answer-class form against HF's own pooler modules, the prediction rules
of run_squad.py `write_predictions` on hand-made beams, and one `squad2` fine-tuning run with
the beam head from an HF XLNet folder."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity_utils import Parity, converted, hf_reference, random_params, xlnet_spiece
from resilience_utils import GRADIENT_STEP, assert_same_step_on_every_mesh, mesh_overrides
from test_squad import squad_json

from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import squad
from pretext_jax.input_pipeline.tokenizers import WordPieceTokenizer, load_tokenizer
from pretext_jax.models.span import BeamSpanExtractor, XLNetBeamConfig
from pretext_jax.objectives import squad as squad_objective
from pretext_jax.pretrain.finetune import finetune_config
from pretext_jax.pretrain.loading import load_pretrained
from pretext_jax.pretrain.trainer import Trainer

S, E = 3, 2  # start_n_top, end_n_top of the parity model


def beam_inputs(vocab_size: int, seed: int = 0):
    """Three windows in run_squad.py's layout, padded on the right: context (types 0, p_mask
    0), the question (types 1, p_mask 1), <cls> (type 2, p_mask 0) at `cls_index`, padding
    (type 3, p_mask 1); gold positions in the context, or at <cls> (impossible)."""
    rng = np.random.default_rng(seed)
    lengths, contexts = [12, 9, 10], [6, 4, 5]
    ids = rng.integers(10, vocab_size, (3, 12))
    types = np.full((3, 12), 3)
    mask, p_mask = np.zeros((3, 12), np.int64), np.ones((3, 12), np.float32)
    cls_index = np.array(lengths) - 1
    for row, (length, context) in enumerate(zip(lengths, contexts, strict=True)):
        types[row, :context + 1], types[row, context + 1:length - 1] = 0, 1
        types[row, length - 1] = 2
        mask[row, :length] = 1
        p_mask[row, :context] = p_mask[row, length - 1] = 0
        ids[row, length:] = 5
    starts = np.array([2, 1, cls_index[2]])
    ends = np.array([4, 1, cls_index[2]])
    return (ids, types, mask, p_mask, cls_index, starts, ends,
            (starts == cls_index).astype(np.float32))


def _hf_beam(model, ids, types, mask, p_mask, cls_index, starts, ends, impossible):
    train = model(input_ids=ids, token_type_ids=types, attention_mask=mask, p_mask=p_mask,
                  cls_index=cls_index, start_positions=starts, end_positions=ends,
                  is_impossible=impossible)
    out = model(input_ids=ids, token_type_ids=types, attention_mask=mask, p_mask=p_mask,
                cls_index=cls_index)
    b = ids.shape[0]
    # HF flattens the end beams end-major ([B, E, S]); run_squad.py (and ours) start-major
    return {"loss": train.loss,
            "start_top_probs": out.start_top_log_probs,  # HF's are softmax probabilities
            "start_top_index": out.start_top_index.float(),
            "end_top_probs": out.end_top_log_probs.view(b, E, S).transpose(1, 2),
            "end_top_index": out.end_top_index.view(b, E, S).transpose(1, 2).float(),
            "cls_logits": out.cls_logits}


def _our_beam(model, ids, types, mask, p_mask, cls_index, starts, ends, impossible):
    del impossible  # the loss reads it from the positions
    batch = {"input_ids": ids, "token_type_ids": types, "attention_mask": mask,
             "p_mask": p_mask, "cls_index": cls_index, "start_positions": starts,
             "end_positions": ends}
    loss, _ = squad_objective.span_loss(model, batch, None)
    out = model.beam(ids, types, mask, p_mask=p_mask, cls_index=cls_index)
    return {"loss": loss, "start_top_probs": jnp.exp(out["start_top_log_probs"]),
            "start_top_index": out["start_top_index"].astype(jnp.float32),
            "end_top_probs": jnp.exp(out["end_top_log_probs"]),
            "end_top_index": out["end_top_index"].astype(jnp.float32),
            "cls_logits": out["cls_logits"]}


HF_CONFIG = dict(vocab_size=60, d_model=24, n_layer=2, n_head=3, d_inner=40, start_n_top=S,
                 end_n_top=E)


@pytest.mark.usefixtures("deterministic_torch")
def test_beam_head_parity_with_hf_both_ways(tmp_path):
    """HF's training loss (gold start in the answer class: `answer_class_start=gold`) and its
    beams and cls logits, on an imported model and on our random model exported and read
    back; then the authors' answer class (the expected start state, function_builder.py)
    against HF's own pooler modules run that way, with HF's gold form as the control; and
    the gold form's gradients against torch's."""
    import torch

    pytest.importorskip("transformers")
    parity = Parity("XLNetForQuestionAnswering", _hf_beam, _our_beam)
    reference = hf_reference("XLNetForQuestionAnswering", 0, **HF_CONFIG)
    inputs = beam_inputs(60)
    model = converted(reference, tmp_path / "in", answer_class_start="gold")
    assert isinstance(model, BeamSpanExtractor)
    assert (model.config.start_n_top, model.config.end_n_top) == (S, E)
    expected = parity.assert_parity(model, reference, *inputs)
    assert (expected["start_top_probs"][:, 0] > expected["start_top_probs"][:, 1]).all()
    ours = random_params(BeamSpanExtractor(XLNetBeamConfig(
        vocab_size=50, hidden_size=24, num_layers=2, num_heads=3, intermediate_size=40,
        start_n_top=S, end_n_top=E, answer_class_start="gold"), rngs=nnx.Rngs(0)), 1)
    _, saved = parity.round_trip(ours, tmp_path / "out", *beam_inputs(50, 1),
                                 answer_class_start="gold")
    assert (saved["start_n_top"], saved["end_n_top"]) == (S, E)
    # The authors' form: HF's modules, the answer class on the softmax-weighted start state.
    authors = converted(reference, tmp_path / "in")
    assert authors.config.answer_class_start == "expected"
    ids, types, mask, p_mask, cls_index, starts, ends, impossible = map(torch.as_tensor, inputs)
    with torch.no_grad():
        hidden = reference.transformer(ids, attention_mask=mask, token_type_ids=types)[0]
        start_logits = reference.start_logits(hidden, p_mask=p_mask)
        end_logits = reference.end_logits(hidden, start_positions=starts, p_mask=p_mask)
        state = torch.einsum("blh,bl->bh", hidden, torch.softmax(start_logits, -1))
        cls = reference.answer_class(hidden, start_states=state, cls_index=cls_index).numpy()

    def cross_entropy(logits, positions):
        log_probs = torch.log_softmax(logits, -1).numpy()
        return -log_probs[np.arange(3), positions.numpy()].mean()

    bce = np.mean(np.logaddexp(0, cls) - impossible.numpy() * cls)
    wanted = (cross_entropy(start_logits, starts) + cross_entropy(end_logits, ends)) / 2
    ours_loss = parity.our_outputs(authors, *inputs)["loss"]
    np.testing.assert_allclose(ours_loss, wanted + 0.5 * bce, atol=1e-5, rtol=0)
    assert abs(ours_loss - expected["loss"]) > 1e-3  # the gold form differs
    # Gradients of HF's loss (gold form) through the head and into the transformer.
    batch = dict(zip(("input_ids", "token_type_ids", "attention_mask", "p_mask", "cls_index",
                      "start_positions", "end_positions"), map(jnp.asarray, inputs[:7]),
                     strict=True))
    grads = nnx.grad(lambda m: squad_objective.span_loss(m, batch, None)[0])(model)
    reference.zero_grad()
    ids, types, mask, p_mask, cls_index, starts, ends, impossible = map(torch.as_tensor, inputs)
    reference(input_ids=ids, token_type_ids=types, attention_mask=mask, p_mask=p_mask,
              cls_index=cls_index, start_positions=starts, end_positions=ends,
              is_impossible=impossible).loss.backward()
    for ours_grad, theirs in (  # torch Linear weights are [out, in]
            (grads["start_dense"]["kernel"][...].T, reference.start_logits.dense.weight),
            (grads["end_dense_0"]["kernel"][...].T, reference.end_logits.dense_0.weight),
            (grads["end_norm"]["scale"][...], reference.end_logits.LayerNorm.weight),
            (grads["answer_dense_0"]["kernel"][...].T, reference.answer_class.dense_0.weight),
            (grads["answer_dense_1"]["kernel"][...].T, reference.answer_class.dense_1.weight),
            (grads["transformer"]["word_embedding"]["embedding"][...],
             reference.transformer.word_embedding.weight)):
        np.testing.assert_allclose(np.asarray(ours_grad), theirs.grad.numpy(), atol=1e-5,
                                   rtol=0)


# --- prediction ------------------------------------------------------------------------------

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", ",",
         "dog", "ran", ".", "what"]


def xlnet_windows():
    """"the cat sat on the mat , the dog ran ." asked "what ran": 11 context sub-tokens in
    windows of 8 (rows 0: 0..7, 1: 3..10), xlnet layout (context from position 0)."""
    tokenizer = WordPieceTokenizer(VOCAB, lowercase=True)
    context = "the cat sat on the mat , the dog ran ."
    words, spans = squad.split_words(context)
    example = squad.SquadExample("q", "what ran", context, tuple(words), tuple(spans),
                                 answers=("dog ran",), start_word=8, end_word=9)
    windows = squad.encode_windows([example], tokenizer, 13, 3, 4, "xlnet")
    return tokenizer, example, windows


def beams_of(windows, pairs, cls=(-1.0, -1.0)):
    """Beam outputs: `pairs` per row, [(start, start log-prob, [(end, end log-prob), ...])]
    (S = 2 starts, E = 2 ends; unused slots at position 9, in the question, log-prob -50)."""
    n = len(windows)
    out = {"start_top_log_probs": np.full((n, 2), -50.0),
           "start_top_index": np.full((n, 2), 9), "end_top_log_probs": np.full((n, 2, 2), -50.0),
           "end_top_index": np.full((n, 2, 2), 9), "cls_logits": np.asarray(cls)}
    for row, starts in pairs.items():
        for i, (start, start_lp, ends) in enumerate(starts):
            out["start_top_index"][row, i], out["start_top_log_probs"][row, i] = start, start_lp
            for j, (end, end_lp) in enumerate(ends):
                out["end_top_index"][row, i, j], out["end_top_log_probs"][row, i, j] = end, end_lp
    return out


def test_beam_prediction_rules_on_hand_made_beams():
    """run_squad.py `write_predictions`: candidates rank by start + end log-prob; a start
    outside the window's max context, an end before the start, a span over
    max_answer_length, or a start/end at the window's last context sub-token never count;
    n-best answers are distinct texts with softmax probabilities; the null score is the
    lowest cls logit over the windows and is the score_diff itself."""
    tokenizer, example, windows = xlnet_windows()
    assert len(windows) == 2 and (windows.cls_index == 13 - 1).all()
    p_mask = windows.arrays["p_mask"]
    assert p_mask[0].tolist() == [0] * 8 + [1] * 4 + [0]  # context, <sep> q <sep>, <cls>
    # row 1 holds sub-tokens 3..10: "dog" (8) at 5, "ran" (9) at 6, "." (10) at 7 (the last)
    dog, ran, last = 5, 6, 7

    def predict(beams, **options):
        return squad.predict_beam_answers([example], windows, beams, tokenizer,
                                          with_null=True, **options)

    beams = beams_of(windows, {1: [(dog, -0.5, [(ran, -0.2), (dog, -0.9)]),
                                   (ran, -1.0, [(ran, -0.1), (dog, -0.1)])]}, cls=(0.5, -2.0))
    out = predict(beams)
    assert out.best_non_null["q"] == "dog ran" and out.text["q"] == "dog ran"
    assert out.score_diff["q"] == -2.0  # the lower cls logit of the two windows
    texts = [text for text, _ in out.nbest["q"]]
    assert texts == ["dog ran", "ran", "dog"]  # -0.7, -1.1, -1.4 (ran->dog: end < start)
    scores = np.array([-0.7, -1.1, -1.4])
    np.testing.assert_allclose([p for _, p in out.nbest["q"]],
                               np.exp(scores) / np.exp(scores).sum())
    assert [t for t, _ in predict(beams, n_best=2).nbest["q"]] == ["dog ran", "ran"]
    assert predict(beams, max_answer_length=1).best_non_null["q"] == "ran"
    beams["cls_logits"][1] = 0.8  # null now 0.5 > threshold 0: empty answer
    out = predict(beams)
    assert out.text["q"] == "" and out.best_non_null["q"] == "dog ran"
    assert predict(beams, null_score_diff_threshold=1.0).text["q"] == "dog ran"
    # run_squad.py's bound: the window's last context sub-token is never a start or end
    edge = beams_of(windows, {1: [(ran, -0.1, [(last, -0.1), (ran, -3.0)])]})
    assert predict(edge).best_non_null["q"] == "ran"
    # max context: sub-token 4 ("the", position 4 of row 0, 1 of row 1) belongs to row 0
    assert windows.max_context[0, 4] and not windows.max_context[1, 1]
    other = beams_of(windows, {1: [(1, -0.1, [(2, -0.1)])], 0: [(4, -2.0, [(4, -2.0)])]})
    assert predict(other).best_non_null["q"] == "the"
    # no valid candidate: run_squad.py's empty "nonce" answer
    none = beams_of(windows, {1: [(ran, -0.1, [(dog, -0.1)])]})
    assert predict(none).nbest["q"] == [("", 1.0)]


# --- a run -----------------------------------------------------------------------------------

SMALL = ["examples.max_seq_length=16", "examples.doc_stride=4", "examples.max_query_length=6",
         "train.batch_size=8", "train.progress=false"]


def write_colour_squad2(data: Path) -> list[str]:
    """SQuAD v2.0 train (8) and dev (4) files in `data`: ten filler words and a colour per
    context, "what color" answered, "what animal" unanswerable. Returns the words used."""
    rng = np.random.default_rng(0)
    filler = ["the", "cat", "sat", "on", "mat", "ran", "."]
    data.mkdir()
    for split, count in (("train", 8), ("dev", 4)):
        paragraphs = []
        for i in range(count):
            words = list(rng.choice(filler, 10))
            colour = str(rng.choice(["red", "blue", "green"]))
            words.insert(int(rng.integers(0, 10)), colour)
            paragraphs.append((" ".join(words), [(f"{split}{i}c", "what color", colour),
                                                 (f"{split}{i}a", "what animal", None)]))
        squad_json(data / f"{split}-v2.0.json", paragraphs)
    return [*filler, "red", "blue", "green", "what", "color", "animal"]


def train_resume_and_mesh_step(folder: Path, data: Path, root: Path):
    """`squad2` fine-tuning of the HF folder `folder` on `data`: two training steps; resumed
    after one step it ends the same; one step on the (2, 2, 2) mesh is the single device's and
    its batch carries the beam head's p_mask and cls_index. Returns (config, trained model)."""
    config = finetune_config("squad2", str(folder), str(data), [
        *SMALL, "train.steps=2", "train.checkpoint_every=1", "optim.learning_rate=1e-3"])
    assert Trainer(config, root / "run").run()["step"] == 2
    trained = load_pretrained(str(root / "run"))
    # Exact resume: 1 step, a restart, 1 more == the 2 straight steps.
    assert Trainer(config, root / "resumed").run(stop_after=1)["step"] == 1
    resumed = nnx.to_flat_state(nnx.state(Trainer(config, root / "resumed").run()[
        "state"].params))
    straight = dict(nnx.to_flat_state(nnx.state(trained, nnx.Param)))
    assert len(straight) == len(resumed)
    for path, value in resumed:
        np.testing.assert_array_equal(np.asarray(value.get_value()),
                                      np.asarray(straight[path].get_value()), err_msg=str(path))

    def trainer_at(workdir, mesh, devices):
        values = {**GRADIENT_STEP, **mesh_overrides(mesh), "optim.learning_rate": 0.1}
        step = finetune_config("squad2", str(folder), str(data), [
            *SMALL, *(f"{k}={v}" for k, v in values.items())])
        return Trainer(step, workdir, devices=devices)

    batch = assert_same_step_on_every_mesh(trainer_at, root / "mesh")
    assert {"p_mask", "cls_index"} <= set(batch)
    return config, trained


def test_xlnet_squad2_with_the_beam_head(tmp_path):
    """XLNet's SQuAD recipe (`model.span_head=beam`) from an HF XLNet folder: trains, resumes
    exactly and steps alike on the (2, 2, 2) mesh (`train_resume_and_mesh_step`), the
    workdir's model is a beam head, the dev windows' p_mask is 0 exactly at the context and
    <cls>, the monitor predicts from the beams; the beam head on another family is refused in
    one line."""
    pytest.importorskip("transformers")
    data = tmp_path / "data"
    words = write_colour_squad2(data)
    folder = tmp_path / "xlnet"
    folder.mkdir()
    vocab = xlnet_spiece(folder, [" ".join(words)] * 20, 40)
    hf_reference("XLNetLMHeadModel", 0, vocab_size=load_tokenizer(vocab).vocab_size,
                 d_model=16, n_layer=1, n_head=2, d_inner=32).save_pretrained(folder)
    config, trained = train_resume_and_mesh_step(folder, data, tmp_path)
    assert (config.model.span_head, config.model.head) == ("beam", "xlnet")  # XLNet's recipe
    assert isinstance(trained, BeamSpanExtractor), type(trained)
    prepared = squad_objective.prepare_squad(config.data, config.examples, tmp_path / "c", 0)
    windows = prepared.monitor_data.windows
    assert ((windows.arrays["p_mask"] == 0) == ((windows.token_words >= 0) | (
        np.arange(16) == windows.cls_index[:, None]))).all()
    metrics = squad_objective.squad_monitor(trained, prepared, config.examples)
    assert 0.0 <= metrics["best_f1"] <= 100.0 and "NoAns_f1" in metrics
    with pytest.raises(UserError, match="model.span_head=beam is the head of"):
        squad_objective.check_squad(
            squad_objective.SpanModelConfig(span_head="beam"), squad_objective.
            SquadExampleConfig())
