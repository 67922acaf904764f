"""LayerDrop (Fan et al. 2020) on models/encoder.py's encoder: the per-layer draws against
their definition over many steps (rate p per layer, independent across layers), p = 0 and
evaluation equal to the encoder without LayerDrop, a drawn layer skipped (its input passed on,
no gradient), pruning at load time (`layers_to_keep`) equal to the full model run with the
other layers skipped and to its smaller HF export, a sharded step equal to the single-device
one and an exact resume with p > 0, and bad settings refused in one line."""

from __future__ import annotations

import dataclasses
import math

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
from text_utils import write_glue_folder

from pretext_jax import run
from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.tokenizers import WordPieceTokenizer
from pretext_jax.models import encoder as encoder_module
from pretext_jax.models.albert import AlbertConfig
from pretext_jax.models.bert import Bert
from pretext_jax.models.encoder import LAYERDROP_STREAM, Encoder, EncoderConfig, layers_dropped
from pretext_jax.objectives import classification
from pretext_jax.pretrain import export
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.finetune import finetune_config
from pretext_jax.pretrain.loading import load_model, load_pretrained
from pretext_jax.pretrain.trainer import Trainer

TINY = EncoderConfig(vocab_size=40, hidden_size=16, num_layers=4, num_heads=2,
                     intermediate_size=32, max_position_embeddings=32)
WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "ran", "far", "away", "and", "then"]


def encoder(config: EncoderConfig) -> Encoder:
    with nnx.use_eager_sharding(False):
        return Encoder(config, rngs=nnx.Rngs(0))


def graphdef(config: EncoderConfig) -> nnx.GraphDef:
    """The graph of an `Encoder` of `config` (no parameters made)."""
    return nnx.graphdef(nnx.eval_shape(lambda: encoder(config)))


def inputs(vocab_size: int = 40) -> tuple[jax.Array, jax.Array]:
    ids = jax.random.randint(jax.random.key(1), (3, 10), 1, vocab_size)
    mask = jnp.ones_like(ids).at[1, 7:].set(0)
    return ids, mask


def stack_key(rng: jax.Array) -> jax.Array:
    """The key `Encoder.__call__` hands its stack (the second of two from `rng`)."""
    return jax.random.split(rng, 2)[1]


def without_layerdrop(model: Encoder, ids, mask, rng, skipped=()) -> jax.Array:
    """The encoder as it was before LayerDrop: embeddings, then each layer in a Python loop with
    its key from the stack key split L ways; layers in `skipped` left out."""
    embed_rng, rng = jax.random.split(rng, 2)
    x = model.embed(ids, jnp.zeros_like(ids), embed_rng)
    keys = jax.random.split(rng, model.config.num_layers)
    graphdef, state = nnx.split(model.stack.layers)
    for i in range(model.config.num_layers):
        if i not in skipped:
            layer = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))
            x = layer(x, mask.astype(bool)[:, None, None, :], keys[i])
    return x


def test_draws_are_independent_per_layer_at_rate_p():
    """Over 20,000 steps' keys: each layer is skipped at rate p, each pair of layers together
    at p^2 (independence), and the number skipped per step follows Binomial(L, p) (chi-square);
    no draw without an rng or with p = 0."""
    p, steps = 0.3, 20000
    config = dataclasses.replace(TINY, num_layers=6, layerdrop=p)
    keys = jax.vmap(lambda s: jax.random.fold_in(jax.random.key(7), s))(jnp.arange(steps))
    drops = np.asarray(jax.vmap(lambda k: layers_dropped(k, config))(keys))  # [S, L]
    assert drops.shape == (steps, 6) and drops.dtype == bool
    sigma = math.sqrt(p * (1 - p) / steps)
    assert np.all(np.abs(drops.mean(0) - p) < 4.5 * sigma), drops.mean(0)
    both = (drops[:, :, None] & drops[:, None, :]).mean(0)[np.triu_indices(6, 1)]
    assert np.all(np.abs(both - p * p) < 4.5 * math.sqrt(p * p * (1 - p * p) / steps)), both
    counts = np.bincount(drops.sum(1), minlength=7)
    expected = np.array([math.comb(6, k) * p**k * (1 - p)**(6 - k) for k in range(7)]) * steps
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 22.5, (counts, expected)  # 6 degrees of freedom: p = 0.001
    # the draw is u < p, u uniform from the step key folded with LAYERDROP_STREAM
    u = jax.random.uniform(jax.random.fold_in(keys[0], LAYERDROP_STREAM), (6,))
    np.testing.assert_array_equal(drops[0], np.asarray(u < p))
    assert layers_dropped(None, config) is None
    assert layers_dropped(keys[0], dataclasses.replace(config, layerdrop=0.0)) is None


def test_skipped_layers_pass_their_input_on_and_p0_and_evaluation_are_unchanged():
    """With p = 0 the stack equals the encoder before LayerDrop (`without_layerdrop`), under
    the Python loop and under scan; with p = 0.5 a step equals it with the drawn layers left
    out, the layers run keeping their own dropout keys; evaluation ignores p (bit for bit); a
    skipped layer's parameters get no gradient, a run one's do."""
    ids, mask = inputs()
    base = encoder(TINY)
    rng = next(jax.random.key(s) for s in range(100)
               if 0 < int(layers_dropped(stack_key(jax.random.key(s)),
                                         dataclasses.replace(TINY, layerdrop=0.5)).sum()) < 3)
    skipped = set(np.flatnonzero(np.asarray(layers_dropped(
        stack_key(rng), dataclasses.replace(TINY, layerdrop=0.5)))))
    references = nnx.jit(lambda m: (without_layerdrop(m, ids, mask, rng),
                                    without_layerdrop(m, ids, mask, rng, skipped),
                                    m(ids, attention_mask=mask)))
    reference, dropped_reference, evaluation = references(base)
    assert not np.allclose(reference, dropped_reference, atol=1e-3)
    def outputs(m: Encoder) -> tuple[jax.Array, jax.Array]:
        return m(ids, attention_mask=mask, rng=rng), m(ids, attention_mask=mask)

    for scan in (False, True):
        config = dataclasses.replace(TINY, scan_layers=scan)
        off, on = (nnx.merge(graphdef(dataclasses.replace(config, layerdrop=p)), nnx.state(base))
                   for p in (0.0, 0.5))
        off, on = nnx.jit(lambda a, b: (outputs(a), outputs(b)))(off, on)
        np.testing.assert_allclose(off[0], reference, atol=1e-6, err_msg=str(scan))
        np.testing.assert_allclose(on[0], dropped_reference, atol=1e-6, err_msg=str(scan))
        np.testing.assert_array_equal(on[1], off[1])
        np.testing.assert_allclose(on[1], evaluation, atol=1e-6)
    on = nnx.merge(graphdef(dataclasses.replace(TINY, layerdrop=0.5)), nnx.state(base))
    grads = nnx.jit(nnx.grad(lambda m: (m(ids, attention_mask=mask, rng=rng) ** 2).sum()))(on)
    kernel = np.asarray(grads.stack.layers.intermediate.kernel[...])  # [L, H, F]
    for i in range(TINY.num_layers):
        assert (np.abs(kernel[i]).max() == 0) == (i in skipped), i


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random 4-layer BERT model directory with a small WordPiece vocabulary."""
    root = tmp_path_factory.mktemp("layerdrop")
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", *WORDS]))
    tokenizer = WordPieceTokenizer.from_vocab_file(vocab)
    config = dataclasses.replace(TINY, vocab_size=tokenizer.vocab_size, hidden_dropout=0.0,
                                 attention_dropout=0.0, layerdrop=0.2)
    with nnx.use_eager_sharding(False):
        model = Bert(config, rngs=nnx.Rngs(3))
    return export.save_model(model, "bert", root / "bert", tokenizer)


def test_pruned_model_is_the_full_one_with_layers_skipped_and_exports_smaller(
        model_dir, tmp_path, monkeypatch):
    """`load_model(layers_to_keep="2,0")` holds layers 0 and 2 only (sorted and renumbered, as
    fairseq's `prune_state_dict`) and equals the full model in a training step whose LayerDrop
    draw skipped layers 1 and 3 (dropout 0); `convert --to hf` of it writes a 2-layer HF
    BertForPreTraining that equals it (<= 1e-5)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    full = load_model(model_dir)
    pruned = load_model(model_dir, layers_to_keep="2,0")
    assert (full.config.num_layers, pruned.config.num_layers) == (4, 2)
    assert pruned.config.layers_to_keep == "" and pruned.config.layerdrop == 0.2
    layers = nnx.state(full.encoder.stack.layers)
    kept = nnx.state(pruned.encoder.stack.layers)
    for (path, value), (_, cut) in zip(nnx.to_flat_state(layers), nnx.to_flat_state(kept),
                                       strict=True):
        np.testing.assert_array_equal(cut[...], value[...][np.array([0, 2])], err_msg=str(path))
    ids, mask = inputs(full.config.vocab_size)
    monkeypatch.setattr(encoder_module, "layers_dropped",
                        lambda rng, config: None if rng is None
                        else jnp.array([False, True, False, True]))
    skipping = full(ids, attention_mask=mask, rng=jax.random.key(0))
    ours = pruned(ids, attention_mask=mask)
    for name in ("hidden_states", "mlm_logits", "nsp_logits"):
        np.testing.assert_allclose(getattr(ours, name), getattr(skipping, name), atol=1e-6,
                                   err_msg=name)
    assert not np.allclose(full(ids, attention_mask=mask).mlm_logits, ours.mlm_logits, atol=1e-3)

    folder = export.convert(model_dir, tmp_path / "hf", to="hf", layers_to_keep="0,2")
    hf = transformers.BertForPreTraining.from_pretrained(folder).eval()
    assert hf.config.num_hidden_layers == 2
    with torch.no_grad():
        theirs = hf(torch.tensor(np.asarray(ids)), attention_mask=torch.tensor(np.asarray(mask)),
                    output_hidden_states=True)
    np.testing.assert_allclose(theirs.hidden_states[-1].numpy(), ours.hidden_states, atol=1e-5)
    np.testing.assert_allclose(theirs.prediction_logits.numpy(), ours.mlm_logits, atol=1e-5)


def test_fine_tuning_starts_from_the_kept_layers(model_dir, tmp_path):
    """`run.py finetune --init W model.init_layers=0,2`: the recipe's model has 2 layers and
    the run starts from layers 0 and 2 of W's encoder (Fan et al. §4: prune, then fine-tune
    without training the dropped ones); an HF folder or a bad list is refused in one line."""
    data = write_glue_folder(tmp_path, WORDS, (16, 8), (4, 4))
    config = finetune_config("sst2", str(model_dir), data, ["model.init_layers=0,2"])
    assert (config.model.num_layers, config.model.init_layers) == (2, "0,2")
    start = classification.pretrained_classifier(config.model, 0, load_pretrained)
    full = nnx.state(load_model(model_dir).encoder.stack.layers)
    kept = nnx.state(start.encoder.stack.layers)
    for (path, value), (_, cut) in zip(nnx.to_flat_state(full), nnx.to_flat_state(kept),
                                       strict=True):
        np.testing.assert_array_equal(cut[...], value[...][np.array([0, 2])], err_msg=str(path))
    assert finetune_config("sst2", str(model_dir), data).model.num_layers == 4  # control
    with pytest.raises(UserError, match=r"\[7\] outside the 4 layers"):
        finetune_config("sst2", str(model_dir), data, ["model.init_layers=0,7"])
    hf_folder = export.convert(model_dir, tmp_path / "hf", to="hf")
    with pytest.raises(UserError, match="takes a pretext model: run.py convert"):
        finetune_config("sst2", str(hf_folder), data, ["model.init_layers=0"])


def test_bad_settings_are_refused_in_one_line(model_dir, tmp_path, capsys):
    assert run.main(["convert", str(model_dir), str(tmp_path / "hf"), "--to", "hf",
                     "--layers-to-keep", "0,9"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "[9] outside the 4 layers" in error, error
    assert not (tmp_path / "hf").exists()
    for spec, match in (("0,4", r"\[4\] outside the 4 layers"), ("1,1", "more than once"),
                        (",", "comma-separated layer indices"), ("0;2", "comma-separated")):
        with pytest.raises(UserError, match=match):
            load_model(model_dir, layers_to_keep=spec)
    with pytest.raises(ValueError, match="must be in"):
        dataclasses.replace(TINY, layerdrop=1.0)
    with pytest.raises(ValueError, match="ALBERT's one shared layer"):
        AlbertConfig(embedding_size=8, hidden_size=16, num_heads=2, layers_to_keep="0")
    with pytest.raises(UserError, match="prunes a trained model as it is loaded"):
        encoder(dataclasses.replace(TINY, layers_to_keep="0,2"))
    with pytest.raises(UserError, match="--to hf"):
        export.convert(tmp_path / "missing", tmp_path / "out", to="pretext", layers_to_keep="0")


def run_overrides(root, **extra):
    """`TINY_BERT` with 4 layers at p = 0.5 on `small_corpus`: 6 steps, checkpoints every 2."""
    return {**TINY_BERT, **small_corpus(root), "model.num_layers": 4, "model.layerdrop": 0.5,
            "train.steps": 6, "train.checkpoint_every": 2, **extra}


def test_sharded_step_equals_single_device_step(tmp_path):
    """A step at p = 0.5 (layers skipped under `jax.lax.cond`) on the (2, 2, 2) mesh equals
    the single-device step: the draw comes from the step's key, the same on every mesh."""
    def trainer_at(workdir, mesh, devices):
        values = run_overrides(tmp_path, **GRADIENT_STEP, **mesh_overrides(mesh))
        return Trainer(make_config("bert_tiny", values), workdir, devices=devices)

    assert assert_same_step_on_every_mesh(trainer_at, tmp_path)["input_ids"].shape == (16, 32)


def test_killed_run_resumes_exactly(tmp_path):
    """A run at p = 0.5 stopped in place of step 3 and resumed from step 2's checkpoint ends
    bit for bit as an uninterrupted one (the draws depend on the step's key only)."""
    values = run_overrides(tmp_path)
    reference = tmp_path / "reference", tmp_path / "reference.log"
    run_in_process("bert_tiny", values, *reference)
    ours = abort_and_resume("bert_tiny", values, tmp_path, step=3)
    executed = assert_same_training("bert_tiny", values, ours, reference)
    assert [step for step, _ in executed].count(3) == 2
