"""Translation fine-tuning with the one trainer (`objectives.translation`): `translation_config`
turns (starting point, parallel training corpus, held-out corpus) into a run of the starting
point's translation method, with its architecture, tokenizer and language ids, and
`translate` trains it and reports the held-out BLEU of its decoding (greedy, or beam search with
`examples.num_beams` > 1, the greedy score then beside it).

The recipe is `translation_tiny`'s sections other than `model` (the model is the starting
point's); `--architecture` without `--init` gives the from-scratch baseline of the same shape
and tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pretext_jax.errors import UserError
from pretext_jax.objectives import registry, translation
from pretext_jax.objectives.common.starts import RUN_FIELDS
from pretext_jax.pretrain.config import Config, as_override, make_config
from pretext_jax.pretrain.directories import find_tokenizer
from pretext_jax.pretrain.loading import load_pretrained
from pretext_jax.pretrain.trainer import Trainer

RESULTS_FILE = "results.json"
RECIPE = "translation_tiny"


def translation_config(init: str, data: str, eval_data: str, overrides: Sequence[str] = (),
                       *, architecture: str = "") -> Config:
    """The translation run from `init` (a pretext workdir or model directory of an
    encoder-decoder; empty: random weights shaped like `architecture`'s) on the parallel
    corpora `data` (training) and `eval_data` (held out); `overrides` (section.key=value)
    win."""
    source = init or architecture
    if not source:
        raise UserError("give a starting point (--init) or, for a random model, the run whose "
                        "architecture and tokenizer to copy (--architecture)")
    model = load_pretrained(source)
    tokenizer = find_tokenizer(Path(source))
    if tokenizer is None:
        raise UserError(f"no tokenizer found for {source}; pass data.tokenizer=...")
    recipe = registry.preset(RECIPE)
    values = {f"{section}.{key}": value for section, settings in recipe.items()
              if section not in ("method", "model") for key, value in settings.items()}
    method = translation.method_of(model)
    skipped = RUN_FIELDS | translation.FAMILIES[method].free_fields
    values.update({f"model.{key}": value for key, value in
                   dataclasses.asdict(model.config).items() if key not in skipped})
    values.update({"method": method, "model.init": init,
                   "data.source": data, "data.eval_source": eval_data,
                   "data.tokenizer": tokenizer})
    return make_config(None, [*(f"{key}={value if isinstance(value, str) else as_override(value)}"
                                for key, value in values.items()), *overrides])


def translate(config: Config, workdir: str | Path) -> dict[str, Any]:
    """Trains `config` in `workdir` (resuming) and writes the final held-out loss and BLEU
    (with beam search also the greedy BLEU) to `<workdir>/results.json`."""
    summary = Trainer(config, workdir).run()
    evaluation, report = summary["eval"], summary["report"]
    result = {"init": config.model.init, "steps": summary["step"],
              "bleu": evaluation.get("bleu"), "held_out_loss": evaluation.get("loss"),
              "held_out_pairs": report["held_out_pairs"], "decoding": report["decoding"],
              "bleu_signature": report["bleu_signature"]}
    if "bleu_greedy" in evaluation:
        result["bleu_greedy"] = evaluation["bleu_greedy"]
    (Path(workdir) / RESULTS_FILE).write_text(json.dumps(result, indent=2))
    return result
