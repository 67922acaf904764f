"""ALBERT's SQuAD v2.0 beam head (`models.span.BeamSpanExtractor` on ALBERT,
google-research/albert squad_utils.py `create_v2_model`, `v2_model_fn_builder`,
`accumulate_predictions_v2`, `write_predictions_v2`; no HF class): its loss, gradients and beam
outputs against a numpy re-statement of squad_utils.py, its prediction rules on hand-made
beams, and one `squad2` fine-tuning run from an HF ALBERT folder."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx
from parity_utils import hf_reference, random_params
from test_squad_beam import VOCAB, beams_of, train_resume_and_mesh_step, write_colour_squad2

from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import squad
from pretext_jax.input_pipeline.tokenizers import WordPieceTokenizer
from pretext_jax.models.hf.conversion import converter_for
from pretext_jax.models.span import BeamSpanExtractor
from pretext_jax.objectives import albert
from pretext_jax.objectives import squad as squad_objective

S, E, T, H = 3, 2, 12, 16  # start_n_top, end_n_top, window length, hidden size


def albert_inputs(vocab_size: int, seed: int = 0):
    """Three windows in squad_utils.py `convert_examples_to_features`' layout: [CLS] (p_mask 0)
    question [SEP] (1) context (0) [SEP] (1), padding (type 0, p_mask 1); gold positions in the
    context, or 0 ([CLS]) with `is_impossible`."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, vocab_size, (3, T))
    types, mask, p_mask = np.zeros((3, T), np.int64), np.zeros((3, T), np.int64), np.ones((3, T))
    for row, (query, context) in enumerate(((3, 6), (2, 5), (4, 5))):
        first, length = query + 2, query + context + 3
        types[row, first:length], mask[row, :length] = 1, 1
        p_mask[row, 0], p_mask[row, first:first + context] = 0, 0
        ids[row, length:] = 0
    starts, ends = np.array([6, 4, 0]), np.array([8, 4, 0])
    return ids, types, mask, p_mask.astype(np.float32), starts, ends, np.array([0., 0., 1.])


HEAD_LAYERS = ("start_dense", "end_dense_0", "end_dense_1", "answer_dense_0", "answer_dense_1")


def head_params(model: BeamSpanExtractor) -> dict[str, np.ndarray]:
    """The head's parameters in float64: `<layer>.kernel` / `.bias`, `end_norm.scale` / `.bias`."""
    out = {}
    for name in (*HEAD_LAYERS, "end_norm"):
        for key, value in vars(getattr(model, name)).items():
            if isinstance(value, nnx.Param):
                out[f"{name}.{key}"] = np.asarray(value[...], np.float64)
    return out


def _dense(x, params, name):
    out = x @ params[f"{name}.kernel"]
    return out + params[f"{name}.bias"] if f"{name}.bias" in params else out


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def numpy_v2_head(params, hidden, p_mask, starts, ends, impossible, cls_at: int = 0,
                  gold_answer_start: bool = False):
    """squad_utils.py `create_v2_model` (both modes) and `v2_model_fn_builder`'s loss on the
    encoder's states `hidden` [B, T, H] with the head's `params` (`head_params`), in float64:
    (loss, beam outputs). Controls: `cls_at` another position than [CLS]'s 0,
    `gold_answer_start` the answer class on the gold start's state."""
    b = np.arange(len(hidden))

    def end_log_probs(start_states):  # [B, K, H] -> [B, K, T], "end_logits" scope
        x = np.concatenate([np.broadcast_to(hidden[:, None], (*start_states.shape[:2], T, H)),
                            np.broadcast_to(start_states[:, :, None], (*start_states.shape[:2],
                                                                       T, H))], -1)
        x = np.tanh(_dense(x, params, "end_dense_0"))
        x = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-12)
        x = x * params["end_norm.scale"] + params["end_norm.bias"]
        logits = _dense(x, params, "end_dense_1")[..., 0]
        return _log_softmax(logits * (1 - p_mask[:, None]) - 1e30 * p_mask[:, None])

    start_logits = _dense(hidden, params, "start_dense")[..., 0] * (1 - p_mask) - 1e30 * p_mask
    start_log_probs = _log_softmax(start_logits)
    start_p = np.exp(start_log_probs)  # softmax_start
    start_state = hidden[b, starts] if gold_answer_start else np.einsum("bth,bt->bh", hidden,
                                                                         start_p)
    answer = np.concatenate([start_state, hidden[:, cls_at]], -1)
    cls_logits = _dense(np.tanh(_dense(answer, params, "answer_dense_0")), params,
                        "answer_dense_1")[:, 0]
    gold_ends = end_log_probs(hidden[b, starts][:, None])[:, 0]
    span = -(start_log_probs[b, starts].mean() + gold_ends[b, ends].mean()) * 0.5
    regression = np.mean(np.logaddexp(0, cls_logits) - impossible * cls_logits)
    start_index = np.argsort(-start_log_probs, -1)[:, :S]
    top_ends = end_log_probs(hidden[b[:, None], start_index])  # [B, S, T]
    end_index = np.argsort(-top_ends, -1)[..., :E]
    return span + 0.5 * regression, {
        "start_top_log_probs": np.take_along_axis(start_log_probs, start_index, 1),
        "start_top_index": start_index,
        "end_top_log_probs": np.take_along_axis(top_ends, end_index, -1).reshape(-1, S * E),
        "end_top_index": end_index.reshape(-1, S * E), "cls_logits": cls_logits}


def tiny_albert_beam() -> BeamSpanExtractor:
    config = squad_objective.SpanModelConfig(
        head="albert", span_head="beam", vocab_size=40, hidden_size=H, embedding_size=8,
        num_layers=2, num_heads=2, intermediate_size=32, max_position_embeddings=T,
        num_labels=2, start_n_top=S, end_n_top=E)
    model = random_params(BeamSpanExtractor(config, rngs=nnx.Rngs(0)), 1)
    kernel = model.answer_dense_1.kernel  # cls logits of order 1, not 0.01
    kernel.set_value(30 * kernel.get_value())
    return model


def test_albert_v2_head_against_squad_utils_restatement():
    """Loss, the head's gradients (central differences of the float64 re-statement) and every
    beam output (start-major, as squad_utils.py reshapes them) <= 1e-5 from create_v2_model;
    controls: the re-statement with the answer class on the last token's state (XLNet's
    <cls>), or on the gold start's state (HF XLNet's training form), is far off ours."""
    model = tiny_albert_beam()
    ids, types, mask, p_mask, starts, ends, impossible = albert_inputs(40)
    batch = {"input_ids": ids, "token_type_ids": types, "attention_mask": mask, "p_mask": p_mask,
             "cls_index": np.zeros(3, np.int32), "start_positions": starts,
             "end_positions": ends}

    @nnx.jit
    def outputs(model, batch):  # one program: eager ops would compile one each
        loss, grads = nnx.value_and_grad(
            lambda m: squad_objective.span_loss(m, batch, None)[0])(model)
        return loss, grads, model.beam(ids, types, mask, p_mask=p_mask, cls_index=batch[
            "cls_index"]), model.hidden(ids, types, mask, None)

    loss, grads, out, hidden = outputs(model, batch)
    hidden = np.asarray(hidden, np.float64)
    params = head_params(model)
    wanted, beams = numpy_v2_head(params, hidden, p_mask, starts, ends, impossible)
    np.testing.assert_allclose(float(loss), wanted, atol=1e-5, rtol=0)
    ours = {**out, "end_top_log_probs": out["end_top_log_probs"].reshape(3, S * E),
            "end_top_index": out["end_top_index"].reshape(3, S * E)}
    for key, value in beams.items():
        np.testing.assert_allclose(np.asarray(ours[key], np.float64), value, atol=1e-5, rtol=0,
                                   err_msg=key)
    assert impossible.tolist() == (starts == 0).tolist()  # the loss reads it from the positions
    last = (mask.sum(1) - 1)[0]  # XLNet's <cls> position
    for control in (numpy_v2_head(params, hidden, p_mask, starts, ends, impossible, last),
                    numpy_v2_head(params, hidden, p_mask, starts, ends, impossible,
                                  gold_answer_start=True)):
        assert abs(control[0] - float(loss)) > 1e-3
        assert np.abs(control[1]["cls_logits"] - np.asarray(out["cls_logits"])).max() > 1e-2
    # Gradients of the head's layers against the re-statement's central differences.
    for name in ("start_dense", "end_dense_1", "answer_dense_1", "end_norm"):
        key = f"{name}.scale" if name == "end_norm" else f"{name}.kernel"
        numeric = np.zeros_like(params[key])
        for index in np.ndindex(numeric.shape):
            values = []
            for sign in (1, -1):
                bumped = params[key].copy()
                bumped[index] += sign * 1e-6
                values.append(numpy_v2_head({**params, key: bumped}, hidden, p_mask, starts,
                                            ends, impossible)[0])
            numeric[index] = (values[0] - values[1]) / 2e-6
        ours_grad = grads[name][key.split(".")[1]][...]
        np.testing.assert_allclose(np.asarray(ours_grad), numeric, atol=1e-5, rtol=0,
                                   err_msg=key)


def test_albert_prediction_rules_on_hand_made_beams():
    """squad_utils.py `accumulate_predictions_v2` / `write_predictions_v2` where they differ
    from XLNet's run_squad.py: the window's last context sub-token may end a span (XLNet's
    rules drop it), and a null score equal to the threshold empties the answer (XLNet's keeps
    it); an unknown rule set is refused."""
    tokenizer = WordPieceTokenizer(VOCAB, lowercase=True)
    context = "the cat sat on the mat , the dog ran ."
    words, spans = squad.split_words(context)
    example = squad.SquadExample("q", "what ran", context, tuple(words), tuple(spans),
                                 answers=("dog ran",), start_word=8, end_word=9)
    windows = squad.encode_windows([example], tokenizer, 16, 4, 4, "bert")
    assert len(windows) == 1 and windows.cls_index.tolist() == [0]
    assert windows.arrays["p_mask"][0].tolist() == [0, 1, 1, 1] + [0] * 11 + [1]
    dog, ran, last = 12, 13, 14  # [CLS] what ran [SEP] the cat ... dog ran . [SEP]
    beams = beams_of(windows, {0: [(dog, -0.5, [(last, -0.1), (ran, -0.3)])]}, cls=(0.0,))

    def predict(rules, **options):
        return squad.predict_beam_answers([example], windows, beams, tokenizer, with_null=True,
                                          rules=rules, **options)

    albert, xlnet = predict("albert"), predict("xlnet")
    assert albert.best_non_null["q"] == "dog ran ." and xlnet.best_non_null["q"] == "dog ran"
    assert albert.text["q"] == "" and xlnet.text["q"] == "dog ran"  # null 0.0 == threshold 0.0
    assert albert.score_diff["q"] == 0.0
    assert predict("albert", null_score_diff_threshold=0.5).text["q"] == "dog ran ."
    with pytest.raises(ValueError, match="rules='bert'"):
        predict("bert")


def test_albert_squad2_with_the_beam_head(tmp_path):
    """ALBERT's SQuAD v2.0 recipe from an HF ALBERT folder: the beam head with run_squad_v2.py's
    0.1 answer-class dropout; two training steps, resumed after one it ends the same, one step
    on the (2, 2, 2) mesh is the single device's; the dev windows' [CLS] is first with p_mask
    0 there and at the context; the monitor predicts from the beams; v1.1 keeps the simple
    head; an HF export is refused in one line (no HF class)."""
    transformers = pytest.importorskip("transformers")
    import sentencepiece as spm

    data = tmp_path / "data"
    words = write_colour_squad2(data)
    folder = tmp_path / "albert"
    folder.mkdir()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([" ".join(words)] * 20),
        model_prefix=str(folder / "spiece"), vocab_size=40, model_type="unigram", pad_id=0,
        unk_id=1, bos_id=-1, eos_id=-1, pad_piece="<pad>", unk_piece="<unk>",
        control_symbols=["[CLS]", "[SEP]", "[MASK]"], num_threads=1, minloglevel=2,
        hard_vocab_limit=False)
    transformers.AlbertTokenizer.from_pretrained(str(folder)).save_pretrained(str(folder))
    hf_reference("AlbertForPreTraining", 0, vocab_size=40, embedding_size=8, hidden_size=16,
                 num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                 max_position_embeddings=16).save_pretrained(folder)
    config, trained = train_resume_and_mesh_step(folder, data, tmp_path)
    assert (config.model.head, config.model.span_head, config.model.classifier_dropout,
            config.examples.layout) == ("albert", "beam", 0.1, "bert")  # run_squad_v2.py's
    assert albert.glue_settings(768, "squad").span_head == ""  # v1.1: the method's simple head
    assert isinstance(trained, BeamSpanExtractor) and trained.config.head == "albert"
    prepared = squad_objective.prepare_squad(config.data, config.examples, tmp_path / "c", 0)
    windows = prepared.monitor_data.windows
    assert (windows.cls_index == 0).all()
    assert ((windows.arrays["p_mask"] == 0) == ((windows.token_words >= 0) | (
        np.arange(16) == 0))).all()
    metrics = squad_objective.squad_monitor(trained, prepared, config.examples)
    assert 0.0 <= metrics["best_f1"] <= 100.0 and "NoAns_f1" in metrics
    with pytest.raises(UserError, match="no HuggingFace conversion for BeamSpanExtractor"):
        converter_for(trained)
