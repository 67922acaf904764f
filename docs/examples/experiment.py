"""A Python config (as big_vision's): `get_config()` returns the same sections as a YAML file.

    python run.py pretrain --config docs/examples/experiment.py --workdir runs/experiment

The preset it names comes first, this file next, `section.key=value` overrides last.
"""


def get_config() -> dict:
    steps = 300
    return {
        "preset": "bert_tiny",
        "data": {"source": "python-docs", "vocab_size": 2000},
        "optim": {"learning_rate": 1e-3, "warmup_steps": steps // 15},
        "train": {"steps": steps, "batch_size": 32, "eval_every": steps // 3,
                  "checkpoint_every": steps // 3},
    }
