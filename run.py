"""pretext command line.

    python run.py                      # offline demo: tiny BERT on the Python docs, a few minutes
    python run.py demo --images        # offline image demo: SimCLR on scikit-learn's digits
    python run.py demo --speech --data free-spoken-digit-dataset/recordings  # CPC on FSDD
    python run.py pretrain --preset bert_tiny --data corpus.txt --workdir runs/x train.steps=100
    python run.py pretrain --config my_experiment.yaml --workdir runs/e train.steps=10
    python run.py convert runs/x hf_out --to hf      # pretext workdir -> HuggingFace directory
    python run.py convert hf_dir model_out --to pretext
    python run.py finetune --task rte --init runs/x --data glue_data --workdir runs/rte
    python run.py eval --workdir runs/rte           # dev metrics of the latest checkpoint
    python run.py glue --init runs/x --data glue_data --workdir runs/glue --seeds 3
    python run.py generate --workdir runs/gpt --prompt "The list" --top-p 0.9  # GPT sampling
    python run.py translate --init runs/mass --data train.en,train.de --eval-data val.en,val.de \
        --workdir runs/en-de                         # translation fine-tune, held-out BLEU
    python run.py --import my_objective.py pretrain --workdir runs/y method=my_method

Bad input prints one line naming the fix and exits with status 2 (no traceback unless
--traceback or PRETEXT_TRACEBACK=1).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import typing
from pathlib import Path
from typing import Any

DEFAULT_PRESET = "bert_tiny"
DEMO_WORKDIR = "runs/demo"
IMAGE_DEMO_WORKDIR = "runs/demo_images"
SPEECH_DEMO_WORKDIR = "runs/demo_speech"
SPEECH_DEMO_PRESET = "cpc_digits"
FSDD_URL = "https://github.com/Jakobovski/free-spoken-digit-dataset"


class _Parser(argparse.ArgumentParser):
    """argparse with pretext's one-line errors (no usage block), exit status 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"error: {self.prog}: {message}; see {self.prog} --help\n")


def _program_name() -> str:
    """How the user called us: the `pretext-jax` console command or `python run.py`."""
    return "pretext-jax" if Path(sys.argv[0]).name == "pretext-jax" else "run.py"


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=_program_name(), description="pretext: self-supervised pre-training in JAX/Flax NNX. "
        "Without a command, runs the offline demo (tiny BERT on the Python docs).")
    parser.add_argument("--traceback", action="store_true", help="show tracebacks for errors")
    parser.add_argument("--import", dest="imports", action="append", default=[],
                        metavar="FILE_OR_MODULE",
                        help="a Python file or module that registers your own objective "
                        "(docs/add_your_own_objective.md); repeatable")
    cluster = parser.add_argument_group(
        "multi-process (one run.py per host; see docs/usage.md, Scaling out)")
    cluster.add_argument("--distributed", action="store_true",
                         help="start JAX's multi-controller runtime, detecting the cluster "
                         "(SLURM, TPU pod slice, Kubernetes, MPI)")
    cluster.add_argument("--coordinator",
                         help="host:port of process 0 (or JAX_COORDINATOR_ADDRESS)")
    cluster.add_argument("--num-processes", type=_bounded(int, 1),
                         help="process count (or JAX_NUM_PROCESSES)")
    cluster.add_argument("--process-id", type=_bounded(int, 0),
                         help="this process (or JAX_PROCESS_ID)")
    commands = parser.add_subparsers(dest="command")

    def add_config_arguments(command: argparse.ArgumentParser) -> None:
        command.add_argument("--preset", help=f"config preset, e.g. bert_base (default "
                             f"{DEFAULT_PRESET}, or none with a --config file that names none)")
        command.add_argument("--config", metavar="FILE",
                             help="a YAML file of config sections, or a Python file whose "
                             "get_config() returns them; layered over the preset, under the "
                             "section.key=value overrides (docs/usage.md, Config files)")

    demo = commands.add_parser("demo", help="pre-train a tiny BERT on the Python docs (offline), "
                               "or SimCLR on digits (--images), or CPC on spoken digits (--speech)")
    demo.add_argument("--images", action="store_true",
                      help="SimCLR on scikit-learn's 8x8 digits instead (pip install "
                      "'pretext-jax[demo]')")
    demo.add_argument("--speech", action="store_true",
                      help="CPC on the Free Spoken Digit Dataset instead, with linear probes "
                      "for digit and speaker (--data; pip install 'pretext-jax[audio]')")
    demo.add_argument("--data", help=f"with --speech: FSDD's recordings/ folder ({FSDD_URL})")
    demo.add_argument("--workdir", type=_workdir,
                      help=f"where checkpoints/logs go (default {DEMO_WORKDIR}, "
                      f"{IMAGE_DEMO_WORKDIR} with --images, {SPEECH_DEMO_WORKDIR} with --speech)")
    demo.add_argument("overrides", nargs="*", help="section.key=value config overrides")

    pretrain = commands.add_parser("pretrain", help="pre-train a model from a preset")
    add_config_arguments(pretrain)
    pretrain.add_argument("--data", help="corpus: file, folder, glob, tfds:NAME or python-docs")
    pretrain.add_argument("--tokenizer", help="sentencepiece .model, BERT vocab.txt or HF dir")
    pretrain.add_argument("--workdir", required=True, type=_workdir,
                          help="run directory (resumes if present)")
    pretrain.add_argument("overrides", nargs="*", help="section.key=value config overrides")

    prepare = commands.add_parser(
        "prepare", help="prepare a preset's data alone (e.g. on CPU hosts before the job)")
    add_config_arguments(prepare)
    prepare.add_argument("--data", help="corpus: file, folder, glob, tfds:NAME or python-docs")
    prepare.add_argument("--tokenizer", help="sentencepiece .model, BERT vocab.txt or HF dir")
    prepare.add_argument("--workdir", required=True, type=_workdir,
                         help="the run directory `pretrain` will use (records go to "
                         "WORKDIR/data, or data.cache_dir)")
    prepare.add_argument("overrides", nargs="*", help="section.key=value config overrides")

    convert = commands.add_parser("convert", help="convert between pretext and HuggingFace")
    convert.add_argument("source", help="pretext workdir/model dir, or HuggingFace dir")
    convert.add_argument("target", help="output directory (must not be an unrelated folder)")
    convert.add_argument("--to", choices=("hf", "pretext"), required=True,
                         help="hf: pretext -> HuggingFace; pretext: HuggingFace -> pretext")
    convert.add_argument("--tokenizer", help="the model's tokenizer (sentencepiece .model, "
                         "vocab.txt or folder) where the source records none")
    convert.add_argument("--layers-to-keep", default="", metavar="I,J,...",
                         help="with --to hf: keep only these encoder layers, e.g. 0,2,4 "
                         "(LayerDrop's pruning, fairseq encoder_layers_to_keep)")

    def add_glue_arguments(command: argparse.ArgumentParser) -> None:
        command.add_argument("--init", default="",
                             help="pretext workdir/model dir (BERT, ELECTRA, RoBERTa, ALBERT, "
                             "MPNet, XLNet, XLM, ELMo; summarize: T5, MASS, ProphetNet) or "
                             "HuggingFace folder of one of them")
        command.add_argument("--architecture", default="",
                             help="with no --init: a checkpoint whose shape a random encoder "
                             "copies (the from-scratch baseline)")
        command.add_argument("--data", default="tfds",
                             help="GLUE folder (SST-2/, CoLA/, ...), for --task ner a folder of "
                             "CoNLL-style train/dev files (or TRAIN,DEV), for --task summarize "
                             "a folder of train/dev .source and .target files or .tsv, for "
                             "--task ctc TRAIN,DEV transcript manifests (TSV of audio path and "
                             "text, or LibriSpeech folders), or tfds: "
                             "TFDS glue/<task> prepared as ArrayRecord in data.tfds_data_dir "
                             "(default ~/tensorflow_datasets) by `tfds build glue/<task> "
                             "--file_format=array_record`; never downloaded (default: "
                             "%(default)s)")
        command.add_argument("--workdir", required=True, type=_workdir,
                             help="run directory (resumes)")
        command.add_argument("--epochs", type=_bounded(float, 0, open_low=True),
                             help="epochs (default: the paper's recipe for the family)")
        command.add_argument("overrides", nargs="*", help="section.key=value config overrides")

    finetune = commands.add_parser("finetune", help="fine-tune on one downstream task")
    finetune.add_argument("--task", required=True,
                          help="a GLUE task (sst2, cola, mrpc, rte, stsb) or another registered "
                          "downstream task; several GLUE tasks comma-separated (sst2,mrpc,...) "
                          "train MT-DNN's multi-task model in WORKDIR/multitask")
    finetune.add_argument("--continue-steps", type=_bounded(int, 1), metavar="N",
                          help="first continue pre-training --init (a pretext pre-training "
                          "workdir, or a HuggingFace checkpoint: the method that trains its "
                          "model) with its own objective on the task's training text for N "
                          "steps (WORKDIR/continue; overrides prefixed continue. apply there), "
                          "then fine-tune the result (WORKDIR/finetune)")
    finetune.add_argument("--finetune-each", action="store_true",
                          help="with several --task: then fine-tune each task from the "
                          "multi-task model (WORKDIR/<task>; overrides prefixed each. apply "
                          "there)")
    finetune.add_argument("--seed", type=_bounded(int, 0), default=0)
    finetune.add_argument("--seeds", type=_bounded(int, 1), default=1,
                          help="runs with seeds SEED, SEED + 1, ... (each in WORKDIR/seed<k>); "
                          "prints each metric's median, as the papers report (BERT, RoBERTa: 5)")
    finetune.add_argument("--config", metavar="FILE",
                          help="a YAML or Python (get_config()) file of config sections, layered "
                          "over the task's recipe and under the section.key=value overrides")
    finetune.add_argument("--recipe", default="", metavar="PRESET",
                          help="another of the method's recipes, where it has several: for "
                          "--task ctc from wav2vec 2.0 ctc_base_10m, ctc_base_1h, ctc_base_10h "
                          "(default), ctc_base_100h, ctc_base_960h (fairseq's per labelled-"
                          "data size)")
    add_glue_arguments(finetune)
    evaluate = commands.add_parser("eval", help="dev metrics of a fine-tuning workdir")
    evaluate.add_argument("--workdir", required=True, type=_workdir,
                          help="a run.py finetune workdir")
    augment = commands.add_parser(
        "augment", help="TinyBERT's data augmentation of a GLUE task's training set (for its "
        "task distillation)")
    augment.add_argument("--task", required=True, help="cola, sst2, mrpc, stsb or rte")
    augment.add_argument("--data", required=True, help="the GLUE folder (holding e.g. SST-2/)")
    augment.add_argument("--out", required=True, type=_workdir,
                         help="a new GLUE folder: the augmented train.tsv, the other splits "
                         "copied (a killed run resumes from here)")
    augment.add_argument("--bert", required=True,
                         help="a BERT with its masked-LM head: HF BertForMaskedLM / "
                         "BertForPreTraining folder (the paper: bert-base-uncased) or a "
                         "pretext bert run")
    augment.add_argument("--glove", help="GloVe text file for words of several WordPieces "
                         "(the paper: glove.6B.300d.txt); without it they stay as they are")
    augment.add_argument("--copies", type=_bounded(int, 1),
                         help="N, variants per sentence (default: the authors' per task)")
    augment.add_argument("--candidates", type=_bounded(int, 1), default=15,
                         help="M, candidates per word (default %(default)s)")
    augment.add_argument("--replace-prob", type=_bounded(float, 0.0), default=0.4,
                         help="p, the chance of replacing a word (default %(default)s)")
    augment.add_argument("--seed", type=_bounded(int, 0), default=0)
    glue = commands.add_parser("glue", help="fine-tune all five GLUE tasks, print the table")
    glue.add_argument("--tasks", default="cola,sst2,mrpc,stsb,rte", help="comma-separated")
    glue.add_argument("--seeds", type=_bounded(int, 1), default=1,
                      help="seeds per task; the table shows the median (papers: 5)")
    glue.add_argument("--learning-rates", type=_rates, default=(),
                      help="comma-separated rates to try; each task reports the best on dev "
                      "(default: the recipe's rate)")
    add_glue_arguments(glue)

    translate = commands.add_parser(
        "translate", help="fine-tune an encoder-decoder (T5, MASS) on translation; held-out BLEU")
    translate.add_argument("--init", default="",
                           help="pretext workdir or model dir of an encoder-decoder (e.g. MASS)")
    translate.add_argument("--architecture", default="",
                           help="with no --init: a run whose architecture and tokenizer a "
                           "random model copies (the from-scratch baseline)")
    translate.add_argument("--data", required=True,
                           help="parallel training corpus, e.g. train.en,train.de (or a .tsv)")
    translate.add_argument("--eval-data", required=True,
                           help="held-out parallel corpus, decoded greedily for BLEU, e.g. "
                           "val.en,val.de")
    translate.add_argument("--workdir", required=True, type=_workdir,
                           help="run directory (resumes)")
    translate.add_argument("overrides", nargs="*", help="section.key=value config overrides, "
                           "e.g. examples.source_language=en examples.target_language=de")

    generate = commands.add_parser(
        "generate", help="continue prompts with a trained GPT (greedy or sampled)")
    generate.add_argument("--workdir", required=True,
                          help="a GPT pretext workdir or model dir, or a HuggingFace GPT-2 "
                          "folder (with vocab.json + merges.txt)")
    generate.add_argument("--prompt", action="append", required=True,
                          help="text to continue; repeat for several (one batch)")
    generate.add_argument("--max-new-tokens", type=_bounded(int, 1), default=50)
    generate.add_argument("--greedy", action="store_true", help="argmax instead of sampling")
    generate.add_argument("--temperature", type=_bounded(float, 0, open_low=True), default=1.0)
    generate.add_argument("--top-k", type=_bounded(int, 0), default=0, help="0 = no top-k cut")
    generate.add_argument("--top-p", type=_bounded(float, 0, 1, open_low=True), default=1.0,
                          help="1 = no nucleus cut")
    generate.add_argument("--seed", type=_bounded(int, 0), default=0, help="sampling seed")
    generate.add_argument("--tokenizer", help="tokenizer override (default: the run's own)")

    commands.add_parser("presets", help="list presets and registered methods")
    show = commands.add_parser(
        "config", help="every config key of a preset with its value, default and doc")
    add_config_arguments(show)
    show.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    return parser


def _config(args: argparse.Namespace, overrides: list[str]) -> Any:
    """The command's config: --preset (default bert_tiny unless a --config file is given),
    --config FILE, then the overrides."""
    from pretext_jax.pretrain.config import make_config

    preset = args.preset or (None if args.config else DEFAULT_PRESET)
    return make_config(preset, overrides, file=args.config)


def _demo(args: argparse.Namespace) -> tuple[str, str, list[str]]:
    """(preset, workdir, overrides) of the demo the arguments ask for."""
    from pretext_jax.errors import UserError

    images, speech = getattr(args, "images", False), getattr(args, "speech", False)
    data, overrides = getattr(args, "data", None), list(getattr(args, "overrides", []))
    if images and speech:
        raise UserError("demo takes --images or --speech, not both; pick one")
    if speech:
        if not data:
            raise UserError(f"demo --speech reads the Free Spoken Digit Dataset, which does not "
                            f"ship with pretext: git clone {FSDD_URL} and pass --data "
                            "free-spoken-digit-dataset/recordings")
        overrides.insert(0, f"data.source={data}")
    elif data:
        raise UserError("demo --data is for --speech (the text and image demos bring their own "
                        "data); drop it or add --speech")
    preset, default_workdir = ((SPEECH_DEMO_PRESET, SPEECH_DEMO_WORKDIR) if speech
                               else ("simclr_digits", IMAGE_DEMO_WORKDIR) if images
                               else (DEFAULT_PRESET, DEMO_WORKDIR))
    return preset, getattr(args, "workdir", None) or default_workdir, overrides


def _pretrain(config: Any, workdir: str) -> tuple[dict, Any]:
    import jax

    from pretext_jax.pretrain.metrics import full_size_note
    from pretext_jax.pretrain.trainer import Trainer

    trainer = Trainer(config, workdir)
    note = full_size_note(sum(leaf.size for leaf in jax.tree.leaves(trainer.abstract_state.params)))
    if note and jax.process_index() == 0:
        print(note, flush=True)
    return trainer.run(), trainer


def _print_summary(summary: dict, seconds: float, trainer: Any) -> None:
    workdir = Path(summary["workdir"])
    evaluation = summary["eval"]
    if summary["stopped_by"]:
        print(f"\nstopped by {summary['stopped_by']} at step {summary['step']} after "
              f"{seconds:.0f} s; checkpoint in {workdir / 'checkpoints'}; rerun to resume")
        return
    print(f"\nfinished step {summary['step']} in {seconds:.0f} s")
    print(f"  checkpoints : {workdir / 'checkpoints'}")
    events = workdir / "tensorboard"
    print(f"  metrics     : {workdir / 'metrics.jsonl'}"
          + (f" (TensorBoard: {events})" if events.is_dir() else ""))
    if summary["curves"]:
        print(f"  curves      : {summary['curves']}")
    method = trainer.method

    def untrained() -> dict[str, float]:  # the monitor of the same network, untrained
        model = method.build_model(trainer.model_config, trainer.config.train.seed)
        return method.evaluation.monitor(model, trainer.data, trainer.example_config,
                                         trainer.objective)

    for line in method.evaluation.summarize(evaluation, summary["report"], untrained):
        print(line)


def _generation_model(path: str, tokenizer_spec: str | None) -> tuple[Any, Any]:
    """The causal LM of a pretext workdir / model dir (its own tokenizer, found as fine-tuning
    finds it) or of a HuggingFace GPT-2 folder (its vocab.json + merges.txt)."""
    from pretext_jax.errors import UserError
    from pretext_jax.input_pipeline.tokenizers import load_tokenizer
    from pretext_jax.pretrain import hf
    from pretext_jax.pretrain.finetune import tokenizer_of
    from pretext_jax.pretrain.loading import load_model

    if hf.is_checkpoint(Path(path)):
        model, tokenizer = hf.load(path), tokenizer_spec or path
    else:
        model, tokenizer = load_model(path), tokenizer_spec or tokenizer_of(path)
    if not hasattr(model, "prefill"):
        raise UserError(f"{path} holds a {type(model).__name__}, not a causal language model; "
                        "generate needs a GPT workdir (method gpt) or a GPT-2 folder")
    tokenizer = load_tokenizer(tokenizer)
    if tokenizer.vocab_size != model.config.vocab_size:
        raise UserError(f"the tokenizer has {tokenizer.vocab_size} ids but the model "
                        f"{model.config.vocab_size}; pass the run's own with --tokenizer")
    return model, tokenizer


def _import_plugin(name: str) -> None:
    """Imports a user's objective: a .py file by path (checked to exist by `_check_paths`),
    else a module by dotted name. An error the plugin raises is one line naming its file and
    line (`_plugin_error`)."""
    import importlib
    import importlib.util

    from pretext_jax.errors import UserError

    path = Path(name)
    try:
        if name.endswith(".py"):
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[path.stem] = module
            spec.loader.exec_module(module)
            # Preparation workers are new processes: they import the objective by its name.
            sys.path.append(str(path.resolve().parent))
            return
        importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name is None or not name.startswith(error.name):
            raise _plugin_error(name, error) from error
        raise UserError(f"--import {name}: {error}; give a .py file or a module on "
                        "PYTHONPATH") from None
    except Exception as error:  # noqa: BLE001  (whatever the user's code raises)
        raise _plugin_error(name, error) from error


def _plugin_error(name: str, error: Exception) -> Exception:
    """A one-line error for `error` raised while importing the plugin `name`, at the plugin's
    own line: a syntax error's, else the deepest frame in a file of the plugin (its .py file,
    or its package's folder), else the deepest frame."""
    import traceback

    from pretext_jax.errors import UserError

    where, message = "", str(error)
    if isinstance(error, SyntaxError) and error.filename:
        where, message = f"{error.filename}, line {error.lineno}", error.msg
    else:
        frames = traceback.extract_tb(error.__traceback__)
        if name.endswith(".py"):
            own = [f for f in frames if Path(f.filename).resolve() == Path(name).resolve()]
        else:  # a file of the module, or of its package's folder
            own = [f for f in frames if f"{os.sep}{name.split('.')[0]}" in f.filename]
        if own or frames:
            frame = (own or frames)[-1]
            where = f"{frame.filename}, line {frame.lineno}"
    message = message.splitlines()[0][:200] if message else ""
    return UserError(f"--import {name} failed at {where}: {type(error).__name__}"
                     f"{': ' + message if message else ''}; fix the plugin (--traceback shows "
                     "the whole traceback)")


# Path arguments checked before anything heavy is imported: (command or None for every command,
# argument, what to give instead).
_PATH_ARGUMENTS = [
    (None, "imports", "give the path of your objective's .py file or an importable module name"),
    ("pretrain", "tokenizer", "give a sentencepiece .model, a BERT vocab.txt or a HuggingFace "
     "tokenizer folder"),
    ("prepare", "tokenizer", "give a sentencepiece .model, a BERT vocab.txt or a HuggingFace "
     "tokenizer folder"),
    ("convert", "source", "give a pretext workdir or model directory, or a HuggingFace folder"),
    ("convert", "tokenizer", "give a sentencepiece .model, a BERT vocab.txt or a tokenizer "
     "folder"),
    ("finetune", "init", "give a pretext workdir or model directory, or a HuggingFace folder"),
    ("finetune", "architecture", "give a pretext workdir or model directory"),
    ("glue", "init", "give a pretext workdir or model directory, or a HuggingFace folder"),
    ("glue", "architecture", "give a pretext workdir or model directory"),
    ("translate", "init", "give a pretext workdir or model directory"),
    ("translate", "architecture", "give a pretext workdir or model directory"),
    ("eval", "workdir", "give the --workdir of a run.py finetune"),
    ("augment", "data", "give the GLUE folder (holding SST-2/, CoLA/, ...)"),
    ("augment", "bert", "give a HuggingFace BERT folder with its masked-LM head or a pretext "
     "bert run"),
    ("augment", "glove", "give a GloVe text file (e.g. glove.6B.300d.txt) or leave --glove out"),
    ("generate", "workdir", "give a GPT workdir or model directory, or a GPT-2 folder"),
    ("generate", "tokenizer", "give a tokenizer file or folder, or leave --tokenizer out"),
]


def _check_paths(args: argparse.Namespace) -> None:
    """Refuses a path argument that names nothing, before JAX and the methods are imported
    (seconds, more under load): the files and folders above, --config, and the paths in
    --data / --eval-data (a GLUE folder for finetune and glue; corpus items otherwise, see
    `corpus.missing_paths`)."""
    from pretext_jax.errors import UserError
    from pretext_jax.input_pipeline.corpus import missing_paths

    for command, name, hint in _PATH_ARGUMENTS:
        if command not in (None, args.command):
            continue
        values = getattr(args, name, None)
        for value in values if isinstance(values, list) else [values]:
            if name == "imports" and not value.endswith(".py"):
                continue  # a module name
            if value and not Path(value).exists():
                flag = "--import" if name == "imports" else f"--{name}"
                raise UserError(f"{flag} {value}: no such file or folder; {hint}")
    config = getattr(args, "config", None)
    if config and not Path(config).is_file():
        raise UserError(f"--config {config}: no such file; give a .yaml or .py config file")
    data = getattr(args, "data", None)
    if args.command in ("finetune", "glue"):
        # A folder, or files comma-separated (NER's TRAIN,DEV[,TEST]).
        missing = [] if data == "tfds" or data.startswith("tfds:") else [
            item for item in data.split(",") if not Path(item).exists()]
        if missing:
            raise UserError(f"--data {missing[0]}: no such folder; give the GLUE folder "
                            "(holding SST-2/, CoLA/, ...; download_glue_data.py writes it), the "
                            "task's folder or its comma-separated files, or tfds")
        return
    for option, value in (("--data", data), ("--eval-data", getattr(args, "eval_data", None))):
        missing = missing_paths(value) if value else []
        if missing:
            raise UserError(f"{option} {missing[0]}: no such file or folder; check the path "
                            "(a file, folder or glob; or tfds:NAME)")


def _workdir(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path would write into the current "
                                         "directory; name a run directory, e.g. runs/x")
    return text


def _bounded(kind: type, low: float, high: float = math.inf, *, open_low: bool = False
             ) -> Any:
    """An argparse type: a finite number of `kind` in [low, high] ((low, high] if
    `open_low`), the range named in the error."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        inside = value is not None and math.isfinite(value) and value <= high and (
            value > low if open_low else value >= low)
        if not inside:
            bounds = f"{'(' if open_low else '['}{low:g}, {high:g}{']' if high < math.inf else ')'}"
            raise argparse.ArgumentTypeError(f"{text!r} must be a finite {kind.__name__} in "
                                             f"{bounds}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _rates(text: str) -> list[float]:
    """Comma-separated learning rates, each finite and > 0."""
    positive = _bounded(float, 0, open_low=True)
    return [positive(rate) for rate in text.split(",") if rate]


def _transfer(args: argparse.Namespace) -> dict[str, Any]:
    """`run.py finetune` in stages (`pretrain.transfer`): MT-DNN on several tasks, or within-task
    continued pre-training then fine-tuning; prints the outcome."""
    from pretext_jax.errors import UserError
    from pretext_jax.pretrain import transfer

    tasks = [task for task in args.task.split(",") if task]
    if len(tasks) > 1:
        if args.continue_steps or args.seeds > 1 or args.recipe:
            raise UserError("several --task train one multi-task model: drop --continue-steps, "
                            "--seeds and --recipe (or give one task)")
        result = transfer.run_multitask(tasks, args.init, args.data, args.workdir,
                                        args.overrides, seed=args.seed, epochs=args.epochs,
                                        architecture=args.architecture,
                                        config_file=args.config,
                                        finetune_each=args.finetune_each)
        for name in result["tasks"]:
            scores = {k.removeprefix(f"{name}_"): v for k, v in result["multitask"].items()
                      if k.startswith(f"{name}_")}
            print(f"{name} dev, multi-task model: "
                  + ", ".join(f"{metric} {value:.4f}" for metric, value in scores.items()))
            if "finetuned" in result:
                print(f"  fine-tuned from it: {_metrics(result['finetuned'][name])}")
        return result
    if args.finetune_each or not args.continue_steps:
        raise UserError("--finetune-each follows a multi-task run: give several --task "
                        "(sst2,mrpc,...)")
    if not args.init or args.architecture:
        raise UserError("--continue-steps continues pre-training a checkpoint: give it as "
                        "--init (not --architecture)")
    result = transfer.run_two_stage(
        args.task, args.init, args.data, args.workdir, args.continue_steps, args.overrides,
        seeds=range(args.seed, args.seed + args.seeds), epochs=args.epochs,
        config_file=args.config, recipe=args.recipe)
    if "dev" in result:
        print(f"{result['task']} dev after {args.continue_steps} steps of continued "
              f"pre-training and {result['steps']} of fine-tuning: {_metrics(result)}")
    else:
        print(f"stopped by {result['stopped_by']} at step {result['step']} of continued "
              "pre-training; the same command resumes it")
    return result


def _metrics(result: dict[str, Any]) -> str:
    """A fine-tuning result's dev metrics, each beside the task's trivial baseline's (GLUE: the
    majority class; SQuAD: no answer; NER: all-O) where it has that metric."""
    from pretext_jax.objectives import registry

    spec = registry.downstream_task(result["task"])
    baseline = result[spec.baseline]
    text = ", ".join(f"{name} {value:.4f}" + (f" ({spec.baseline_name} {baseline[name]:.4f})"
                                              if name in baseline else "")
                     for name, value in result["dev"].items())
    if result[f"at_{spec.baseline}"]:
        text += (f"\n  the run ended at the {spec.baseline_name} baseline (no better than that "
                 "trivial predictor); try another learning rate, seed or more epochs")
    return text


def _interrupt_again_if_dropped(previous_hook: typing.Callable) -> typing.Callable:
    """A `sys.unraisablehook` for the CLI. Python prints and forgets an exception raised where
    it cannot propagate: a garbage-collector callback (jax registers one), a `__del__`, a
    weakref callback. A Ctrl-C landing there would let the run go on to its end (seen: a
    `prepare` finishing with exit 0 after SIGINT), so the main thread is interrupted again a
    moment later, once that callback has returned (a signal to the main thread, which also ends
    a sleep or a blocking read). Other exceptions go to `previous_hook`."""
    import signal
    import threading

    def hook(unraisable: typing.Any) -> None:
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
            threading.Timer(0.01, signal.pthread_kill,
                            (threading.main_thread().ident, signal.SIGINT)).start()
        else:
            previous_hook(unraisable)
    return hook


def main(argv: list[str] | None = None) -> int:
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _interrupt_again_if_dropped(previous_hook)
    try:
        return _main(argv)
    finally:
        sys.unraisablehook = previous_hook


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    show_traceback = args.traceback or os.environ.get("PRETEXT_TRACEBACK") == "1"
    from pretext_jax.errors import UserError

    try:
        _check_paths(args)
        from pretext_jax.pretrain.resilience import initialize_distributed

        initialize_distributed(args.coordinator, args.num_processes, args.process_id,
                               auto=args.distributed)
        from pretext_jax import objectives  # noqa: F401  (registers the methods)

        for plugin in args.imports:
            _import_plugin(plugin)

        start = time.perf_counter()
        if args.command in (None, "demo"):
            preset, workdir, overrides = _demo(args)
            from pretext_jax.pretrain.config import make_config

            summary, trainer = _pretrain(make_config(preset, overrides), workdir)
            _print_summary(summary, time.perf_counter() - start, trainer)
        elif args.command in ("pretrain", "prepare"):
            overrides = list(args.overrides)
            if args.data:
                overrides.append(f"data.source={args.data}")
            if args.tokenizer:
                overrides.append(f"data.tokenizer={args.tokenizer}")
            config = _config(args, overrides)
            if args.command == "prepare":
                from pretext_jax.pretrain.trainer import data_cache, prepare_data

                prepare_data(config, args.workdir)
                print(f"records ready in {data_cache(config, args.workdir)}; "
                      f"`run.py pretrain --workdir {args.workdir}` with the same settings "
                      "reuses them")
            else:
                summary, trainer = _pretrain(config, args.workdir)
                _print_summary(summary, time.perf_counter() - start, trainer)
        elif args.command == "finetune":
            from pretext_jax.pretrain import finetune

            if "," in args.task or args.continue_steps or args.finetune_each:
                result = _transfer(args)
            elif args.seeds > 1:
                result = finetune.finetune_seeds(
                    args.task, args.init, args.data, args.workdir,
                    range(args.seed, args.seed + args.seeds), args.overrides, epochs=args.epochs,
                    architecture=args.architecture, config_file=args.config,
                    recipe=args.recipe)
                print(f"{result['task']} dev, median of {args.seeds} seeds after "
                      f"{result['steps']} steps: {_metrics(result)}")
            else:
                config = finetune.finetune_config(args.task, args.init, args.data,
                                                  args.overrides, seed=args.seed,
                                                  epochs=args.epochs,
                                                  architecture=args.architecture,
                                                  config_file=args.config,
                                                  recipe=args.recipe)
                result = finetune.finetune(config, args.workdir)
                print(f"{result['task']} dev after {result['steps']} steps: {_metrics(result)}")
        elif args.command == "eval":
            from pretext_jax.pretrain import finetune

            result = finetune.evaluate(args.workdir)
            print(f"{result['task']} dev at step {result['step']}: {_metrics(result)}")
        elif args.command == "augment":
            from pretext_jax.pretrain.augment import AugmentSettings, augment_glue

            result = augment_glue(args.task, args.data, args.out, args.bert, args.glove,
                                  AugmentSettings(args.copies or 0, args.candidates,
                                                  args.replace_prob, args.seed))
            kept = "" if args.glove else "; words of several pieces kept (no --glove)"
            print(f"{result['task']}: {result['rows']:,} training rows -> "
                  f"{result['augmented_rows']:,} in {result['out']} (N {result['copies']}, M "
                  f"{result['candidates']}, p {result['replace_prob']}{kept})")
        elif args.command == "glue":
            from pretext_jax.pretrain import finetune

            finetune.run_glue(args.init, args.data, args.workdir,
                              tasks=args.tasks.split(","), seeds=range(args.seeds),
                              overrides=args.overrides, architecture=args.architecture,
                              epochs=args.epochs,
                              learning_rates=args.learning_rates)
            print((Path(args.workdir) / finetune.TABLE_FILE).read_text())
        elif args.command == "translate":
            from pretext_jax.pretrain import translate

            config = translate.translation_config(args.init, args.data, args.eval_data,
                                                  args.overrides,
                                                  architecture=args.architecture)
            result = translate.translate(config, args.workdir)
            greedy = (f", greedy {result['bleu_greedy']:.2f}" if "bleu_greedy" in result
                      else "")
            print(f"held-out BLEU after {result['steps']} steps: {result['bleu']:.2f} on "
                  f"{result['held_out_pairs']} pairs ({result['decoding']}{greedy}; sacrebleu "
                  f"{result['bleu_signature']}); loss {result['held_out_loss']:.3f}")
        elif args.command == "convert":
            from pretext_jax.pretrain import export

            out = export.convert(args.source, args.target, to=args.to,
                                 tokenizer=args.tokenizer, layers_to_keep=args.layers_to_keep)
            print(f"wrote {out}")
        elif args.command == "generate":
            from pretext_jax.models.generate import Sampling, generate_text

            sampling = Sampling(greedy=args.greedy, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed)
            model, tokenizer = _generation_model(args.workdir, args.tokenizer)
            for text in generate_text(model, tokenizer, args.prompt,
                                      max_new_tokens=args.max_new_tokens, sampling=sampling):
                print(text)
        elif args.command == "config":
            from pretext_jax.pretrain.config import describe

            print(describe(_config(args, args.overrides)))
        elif args.command == "presets":
            from pretext_jax.objectives import registry

            for name in registry.preset_names():
                print(f"{name:14s} method={registry.preset(name)['method']}")
            for name in registry.names():
                print(f"method {name}: {registry.get(name).description}")
    except UserError as error:
        if show_traceback:
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # the file system refused: permissions, a full disk, a file
        if show_traceback:   # where a folder belongs, ...
            raise
        where = f" ({error.filename})" if error.filename else ""
        print(f"error: {error.strerror or error}{where}; check that path's permissions, free "
              "space and type, or rerun with --traceback", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
