"""Recipe cards: every paper preset has one card in its method's docs page
(docs/methods/*.md), a `#### Recipe card: `preset`` heading over a table whose rows are the
settings the paper or the authors' code fixes: the paper's (or code's) value, ours, the reference
(file:line or §) and, where ours differs, the departure's reason. A row whose setting is a config
key (`optim.learning_rate`) is checked against `make_config(preset)`, so a card cannot drift from
the code; a row whose two values differ must give its reason. Presets of our own (test sizes,
demos, downstream) have no card and are listed in `EXEMPT` with why. docs/recipes.md's table,
which says per paper preset which settings depart, is made from the cards
(`python tests/test_recipe_cards.py` writes it) and checked against them."""

from __future__ import annotations

import ast
import dataclasses
import math
import re
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.objectives import registry
from pretext_jax.pretrain.config import make_config

REPO = Path(__file__).resolve().parent.parent
METHODS_DOCS = REPO / "docs" / "methods"

# The page that holds each method's cards.
PAGES = {
    **dict.fromkeys(("bert", "roberta", "albert", "electra", "structbert", "ernie", "mpnet",
                     "infoword", "distilbert", "tinybert", "tinybert_task"), "masked_lm.md"),
    **dict.fromkeys(("gpt", "xlnet", "transformer_xl", "elmo", "word2vec"),
                    "autoregressive.md"),
    **dict.fromkeys(("t5", "mass", "mass_xlm", "prophetnet", "unilm", "xlm", "summarize",
                     "summarize_prophetnet", "summarize_unilm", "unicoder"), "seq2seq.md"),
    **dict.fromkeys(("simclr", "moco", "byol", "rotation", "jigsaw", "context", "deepcluster",
                     "cmc", "dim", "amdim", "semi", "local_aggregation"), "images.md"),
    **dict.fromkeys(("cpc", "wav2vec", "wav2vec2", "hubert", "ctc", "ctc_hubert"), "speech.md"),
}

# Presets that are ours, not a paper's recipe: no card.
TEST_SIZES = ("albert_tiny", "amdim_tiny", "bart_tiny", "bert_tiny", "byol_tiny", "cmc_tiny",
              "context_tiny", "cpc_tiny", "deepcluster_tiny", "dim_tiny", "distilbert_tiny",
              "electra_tiny", "elmo_tiny", "ernie_tiny", "gpt_tiny", "hubert_tiny", "infoword_tiny",
              "jigsaw_tiny", "local_aggregation_tiny", "mass_tiny", "mass_bilingual_tiny",
              "mass_xlm_tiny",
              "moco_tiny", "mpnet_tiny", "prophetnet_tiny", "roberta_tiny", "rotation_tiny",
              "simclr_tiny", "structbert_tiny", "t5_tiny", "tinybert_tiny", "tinybert_task_tiny",
              "transformer_xl_tiny", "translation_tiny", "unicoder_tiny", "unilm_tiny",
              "unilm_summarize_tiny",
              "wav2vec_tiny", "wav2vec2_tiny", "word2vec_tiny", "xlm_tiny", "xlnet_tiny")
EXEMPT = {
    **dict.fromkeys(TEST_SIZES, "the test and demo size (`preset_parts`)"),
    "bert_small": "an intermediate size for short runs (4 x 256: google-research/bert's "
                  "BERT-Mini shape, 20k steps at 5e-4 on a 16k vocabulary): our recipe",
    "simclr_digits": "the offline image demo (8x8 digits)",
    "cpc_digits": "the speech demo (FSDD)",
    "wav2vec2_digits": "the speech benchmark on FSDD (bench/speech_fsdd.py)",
    "hubert_digits": "the speech benchmark on FSDD",
    "hubert_digits_iter2": "the speech benchmark on FSDD, second iteration",
    "wav2vec_digits": "the speech benchmark on FSDD",
    "elmo_tiny_glue": "the downstream scalar-mix classifier at the test size",
}

SECTIONS = ("data", "optim", "train", "mesh", "model", "examples", "objective")
# Keys every card states.
REQUIRED = ("optim.optimizer", "optim.learning_rate", "train.batch_size", "train.steps")
HEADER = ["setting", "paper / authors' code", "ours", "reference", "departure"]
HEADING = re.compile(r"^#### Recipe card: `([a-z0-9_]+)`\s*$")
KEY = re.compile(rf"^`({'|'.join(SECTIONS)})\.([a-z_0-9]+)`$")
CELL_SEPARATOR = re.compile(r"(?<!\\)\|")
THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+$")
FRACTION = re.compile(r"^(-?\d+)/(\d+)$")
PERCENT = re.compile(r"^(-?\d+(?:\.\d+)?)\s?%$")


@dataclasses.dataclass(frozen=True)
class Row:
    setting: str
    paper: str
    ours: str
    reference: str
    departure: str
    line: int
    width: int = len(HEADER)


@dataclasses.dataclass(frozen=True)
class Card:
    preset: str
    page: str
    line: int
    rows: tuple[Row, ...]


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in CELL_SEPARATOR.split(line.strip())[1:-1]]


def read_cards(text: str, page: str) -> list[Card]:
    """The cards of one page's Markdown `text`: each heading, then (after any lines of prose)
    its table: header, separator, rows. A heading whose first table before the next heading is
    not of `HEADER`'s columns is a card with no rows."""
    lines, cards = text.splitlines(), []
    for index, line in enumerate(lines):
        match = HEADING.match(line)
        if not match:
            continue
        start = index + 1
        while start < len(lines) and not lines[start].startswith(("|", "#")):
            start += 1
        rows: list[Row] = []
        if start < len(lines) and cells(lines[start]) == HEADER:
            end = start + 2
            while end < len(lines) and lines[end].startswith("|"):
                row = cells(lines[end])
                padded = row + [""] * (len(HEADER) - len(row))
                rows.append(Row(*padded[:len(HEADER)], line=end + 1, width=len(row)))
                end += 1
        cards.append(Card(match.group(1), page, index + 1, tuple(rows)))
    return cards


def all_cards() -> list[Card]:
    return [card for path in sorted(METHODS_DOCS.glob("*.md"))
            for card in read_cards(path.read_text(encoding="utf-8"), path.name)]


def value(text: str) -> Any:
    """A cell as a value: numbers (1e-4, 10,000, 1/3, 15%), true/false, Python literals
    (quoted strings, lists); anything else is its text, backticks and spacing dropped."""
    text = " ".join(text.replace("`", "").split())
    if THOUSANDS.match(text):
        return int(text.replace(",", ""))
    if match := FRACTION.match(text):
        return Fraction(int(match.group(1)), int(match.group(2)))
    if match := PERCENT.match(text):
        return Fraction(match.group(1)) / 100
    if text in ("true", "false"):
        return text == "true"
    try:
        parsed = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text
    return parsed if isinstance(parsed, (bool, int, float, str, list, tuple)) else text


def same(a: Any, b: Any) -> bool:
    """Equal values: numbers to 1e-12 (an int equals its float), bools only to bools, lists and
    tuples element by element, anything else by ==."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float, Fraction)) and isinstance(b, (int, float, Fraction)):
        return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def check_card(card: Card, config: Any) -> list[str]:
    """What is wrong with one card against its preset's resolved `config`: a config-key row
    whose 'ours' is not the preset's value (or names no key), a row whose paper value differs
    from ours without a departure reason, a row without a reference, a key stated twice, a
    `REQUIRED` key missing."""
    problems, keys = [], []
    where = f"{card.page}:{card.line} ({card.preset})"
    if not card.rows:
        return [f"{where}: no table with the columns {HEADER}"]
    for row in card.rows:
        at = f"{card.page}:{row.line} ({card.preset}, {row.setting})"
        if row.width != len(HEADER):
            problems.append(f"{at}: {row.width} cells, not {len(HEADER)} (escape a | as \\|)")
        if not row.paper or not row.ours or not row.reference:
            problems.append(f"{at}: the paper, ours and reference cells must all be filled")
        if not same(value(row.paper), value(row.ours)) and not row.departure:
            problems.append(f"{at}: the paper's {row.paper!r} differs from ours {row.ours!r}; "
                            "give the departure's reason")
        key = KEY.match(row.setting)
        if key is None:
            if re.match(r"^`\w+\.\w+`$", row.setting):
                problems.append(f"{at}: {row.setting} is in no config section {SECTIONS}")
            continue
        section, name = key.groups()
        keys.append(f"{section}.{name}")
        part = getattr(config, section)
        if not hasattr(part, name):
            problems.append(f"{at}: the {section} section has no key {name!r}")
            continue
        actual = getattr(part, name)
        if not same(value(row.ours), actual):
            problems.append(f"{at}: the card says {row.ours!r}, the preset has {actual!r}")
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        problems.append(f"{where}: keys stated more than once: {repeated}")
    missing = [key for key in REQUIRED if key not in keys]
    if missing:
        problems.append(f"{where}: no row for {missing}")
    return problems


def card_set_problems(cards: list[Card], presets: dict[str, str]) -> list[str]:
    """What is wrong with the set of cards against `presets` (paper preset -> method): a
    preset with no card or with several, a card of no paper preset, a card on another method's
    page."""
    problems, named = [], [card.preset for card in cards]
    page = {preset: PAGES.get(method, "<no page for its method in PAGES>")
            for preset, method in presets.items()}
    for preset in sorted(set(presets) - set(named)):
        problems.append(f"{preset} has no recipe card (docs/methods/{page[preset]})")
    for card in cards:
        if card.preset not in presets:
            problems.append(f"{card.page}:{card.line}: a card of {card.preset!r}, which is not "
                            "a paper preset")
        elif named.count(card.preset) > 1:
            problems.append(f"{card.page}:{card.line}: a second card of {card.preset}")
        elif card.page != page[card.preset]:
            problems.append(f"{card.page}:{card.line}: {card.preset}'s card belongs in "
                            f"{page[card.preset]}")
    return problems


def built_in_presets() -> dict[str, str]:
    """Every preset of the package's methods -> its method."""
    return {preset: name for name in registry.names()
            if getattr(registry.get(name).loss, "func", registry.get(name).loss)
            .__module__.startswith("pretext_jax.objectives.")
            for preset in registry.get(name).presets}


def paper_presets() -> dict[str, str]:
    return {preset: method for preset, method in built_in_presets().items()
            if preset not in EXEMPT}


CARDS = {card.preset: card for card in all_cards()}
SUMMARY = REPO / "docs" / "recipes.md"
SUMMARY_START, SUMMARY_END = "<!-- cards: start -->", "<!-- cards: end -->"


def summary_table(cards: list[Card]) -> str:
    """One row per card: the preset, its page, how many settings the card states and those
    with a departure (a reason in the card's last column; "none" = the reference's recipe)."""
    lines = ["| preset | card | settings stated | settings that depart |", "|---|---|---|---|"]
    for card in sorted(cards, key=lambda c: c.preset):
        departing = [row.setting for row in card.rows if row.departure]
        anchor = f"recipe-card-{card.preset}"
        lines.append(f"| `{card.preset}` | [{card.page}](methods/{card.page}#{anchor}) | "
                     f"{len(card.rows)} | {', '.join(departing) or 'none'} |")
    return "\n".join(lines)


def summary_in_docs() -> str:
    text = SUMMARY.read_text(encoding="utf-8")
    return text[text.index(SUMMARY_START) + len(SUMMARY_START):text.index(SUMMARY_END)].strip()


def test_recipes_page_lists_every_card_and_its_departures():
    assert summary_in_docs() == summary_table(list(CARDS.values())), (
        "docs/recipes.md is out of date: run `python tests/test_recipe_cards.py`")


# ---------------------------------------------------------------------------------- the set
def test_exempt_presets_exist():
    assert not set(EXEMPT) - set(built_in_presets()), "EXEMPT names presets that do not exist"


def test_every_paper_preset_has_one_card_on_its_methods_page():
    problems = card_set_problems(all_cards(), paper_presets())
    assert not problems, "\n".join(problems)


def test_every_method_with_a_paper_preset_has_a_page():
    assert not {method for method in paper_presets().values()} - set(PAGES)


# ---------------------------------------------------------------------------------- each card
@pytest.mark.parametrize("preset", sorted(paper_presets()))
def test_card_matches_its_preset(preset):
    card = CARDS.get(preset)
    assert card is not None, f"{preset} has no recipe card"
    problems = check_card(card, make_config(preset))
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------- controls
def edited(card: Card, row_setting: str, **cells_: str) -> Card:
    rows = tuple(dataclasses.replace(row, **cells_) if row.setting == row_setting else row
                 for row in card.rows)
    assert rows != card.rows, f"{card.preset}'s card has no row {row_setting}"
    return dataclasses.replace(card, rows=rows)


def test_a_card_edited_in_its_page_text_is_rejected():
    """One 'ours' value changed in bert_base's page text: the same reader and checker refuse
    it (and accept the text as it is)."""
    card = CARDS["bert_base"]
    path = METHODS_DOCS / card.page
    lines = path.read_text(encoding="utf-8").splitlines()
    row = next(row for row in card.rows if row.setting == "`optim.learning_rate`")
    parts = CELL_SEPARATOR.split(lines[row.line - 1])
    assert value(parts[3]) == 1e-4
    parts[3] = " 2e-4 "
    lines[row.line - 1] = "|".join(parts)
    config = make_config("bert_base")
    before = next(c for c in read_cards(path.read_text(encoding="utf-8"), card.page)
                  if c.preset == "bert_base")
    after = next(c for c in read_cards("\n".join(lines), card.page) if c.preset == "bert_base")
    assert not check_card(before, config)
    problems = check_card(after, config)
    assert len(problems) == 2, problems  # not the preset's value, and now unlike the paper's
    assert any("the preset has 0.0001" in p for p in problems), problems


def test_checker_rejects_drift_missing_reasons_and_unknown_keys():
    card, config = CARDS["bert_base"], make_config("bert_base")
    assert not check_card(card, config)
    drift = edited(card, "`train.steps`", ours="900,000", departure="a reason")
    assert any("the preset has 1000000" in p for p in check_card(drift, config))
    unexplained = next(row for row in card.rows if row.departure)
    silent = edited(card, unexplained.setting, departure="")
    assert any("give the departure's reason" in p for p in check_card(silent, config))
    unknown = edited(card, "`train.steps`", setting="`train.step_count`")
    problems = check_card(unknown, config)
    assert any("no key 'step_count'" in p for p in problems), problems
    assert any("no row for ['train.steps']" in p for p in problems), problems
    misspelt = edited(card, "`optim.eps`", setting="`optimizer.eps`")
    assert any("is in no config section" in p for p in check_card(misspelt, config))


def test_set_check_sees_a_missing_card_a_stray_card_and_a_wrong_page():
    cards, presets = all_cards(), paper_presets()
    stray = dataclasses.replace(CARDS["bert_base"], preset="bert_huge")
    misplaced = dataclasses.replace(CARDS["bert_base"], page="images.md")
    problems = card_set_problems(
        [c for c in cards if c.preset != "bert_base"] + [stray, misplaced], presets)
    assert any(p.startswith("bert_huge") or "'bert_huge'" in p for p in problems), problems
    assert any("belongs in masked_lm.md" in p for p in problems), problems
    problems = card_set_problems([c for c in cards if c.preset != "gpt2_small"], presets)
    assert problems == ["gpt2_small has no recipe card (docs/methods/autoregressive.md)"]


def test_cell_values():
    assert value("10,000") == 10000 and value("1e-4") == 1e-4 and value("`adamw`") == "adamw"
    assert value("1/3") == Fraction(1, 3) and same(value("1/3"), 1 / 3)
    assert value("15%") == Fraction(3, 20) and same(value("15 %"), 0.15)
    assert value("true") is True and not same(value("1"), True)
    assert value('"23460,46920,62560"') == "23460,46920,62560"
    assert same(value("[512, 512]"), (512, 512)) and not same(value("0.98"), 0.999)
    assert value("80/10/10 of `[MASK]`") == "80/10/10 of [MASK]"


def test_a_row_with_a_stray_cell_separator_is_rejected():
    text = "\n".join(["#### Recipe card: `bert_base`", "", "| " + " | ".join(HEADER) + " |",
                      "|---|---|---|---|---|",
                      "| `train.steps` | 1,000,000 | 1,000,000 | a | b | extra |"])
    (card,) = read_cards(text, "masked_lm.md")
    problems = check_card(card, make_config("bert_base"))
    assert any("6 cells, not 5" in p for p in problems), problems


if __name__ == "__main__":
    text = SUMMARY.read_text(encoding="utf-8")
    head, tail = text.split(SUMMARY_START)[0], text.split(SUMMARY_END)[1]
    SUMMARY.write_text(f"{head}{SUMMARY_START}\n{summary_table(list(CARDS.values()))}\n"
                       f"{SUMMARY_END}{tail}", encoding="utf-8")
