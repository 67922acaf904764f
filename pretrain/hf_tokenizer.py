"""A pretext tokenizer as HuggingFace tokenizer files, so that
`transformers.AutoTokenizer.from_pretrained(folder)` gives pretext's ids
(`tok(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text)`) and its special
tokens (pad, unk, cls, sep, mask, eos; bos is cls).

- WordPiece: `vocab.txt` + `tokenizer_config.json` with `do_lower_case`, read by
  `BertTokenizer` (`ElectraTokenizer` for ELECTRA, `MPNetTokenizer` for MPNet).
- byte-level BPE: `vocab.json` + `merges.txt`, read by `RobertaTokenizer` when the vocabulary
  has RoBERTa's specials, else `GPT2Tokenizer`; no prefix space, as pretext encodes.
- XLM's Moses + BPE: `vocab.json` + `merges.txt` with its casing and language table, read by
  `XLMTokenizer` (sentences start and end with </s>, XLM's convention, as pretext's).
- sentencepiece: `spiece.model` + `tokenizer.json`, a `tokenizers` Unigram model with the
  model's pieces and scores behind sentencepiece's own normalisation (the precompiled charsmap,
  whitespace handling, `▁` prefix), as transformers' convert_slow_tokenizer.py `SpmConverter`
  builds it, read by `PreTrainedTokenizerFast`, with the family's special-token template.
  XLNet's `spiece.model` is built as `XLNetConverter` does it and read by `XLNetTokenizer`:
  prepro_utils.py's text handling as normalizers, and pieces that end in a digit and a comma
  scored down by 100, HF's stand-in for XLNet's re-splitting of such pieces. ALBERT's is built
  as transformers' `AlbertTokenizer` builds it (its text handling as normalizers, the words
  split at whitespace) and read by `AlbertTokenizer`.
- T5: the model's `extra_ids` sentinels `<extra_id_0>`, ... from the top id down.

Special-token strings inside text (`[MASK]`, `<unk>`) become those tokens, HF's convention
(fill-mask needs it), where pretext's WordPiece and sentencepiece tokenizers read them as text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.tokenizers import (
    GPT2_EOT,
    TOKENIZER_CONFIG,
    AlbertSentencePieceTokenizer,
    ByteLevelBPETokenizer,
    MosesBPETokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    WordPieceTokenizer,
    XLNetSentencePieceTokenizer,
)

TOKENIZER_JSON = "tokenizer.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
# What `save` writes (besides the pretext tokenizer's own files): a new tokenizer replaces these.
FILES = (TOKENIZER_JSON, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, "added_tokens.json", "vocab.txt",
         "vocab.json", "merges.txt", "spiece.model", "sentencepiece.bpe.model",
         "tokenizer.model")
WORDPIECE_CLASSES = {"electra": "ElectraTokenizer", "mpnet": "MPNetTokenizer"}
# `tokenizer(text)`'s layout per HF model type (pretext's example builders) in `tokenizer.json`
# (what `PreTrainedTokenizerFast` reads; the HF classes have their own). Default: BERT's.
TEMPLATES: dict[str, tuple[str, str] | None] = {
    "gpt2": None,
    "prophetnet": ("$A:0 {sep}:0", "$A:0 {sep}:0 $B:0 {sep}:0"),
    "t5": ("$A:0 {eos}:0", "$A:0 {eos}:0 $B:0 {eos}:0"),
    "xlnet": ("$A:0 {sep}:0 {cls}:2", "$A:0 {sep}:0 $B:1 {sep}:1 {cls}:2"),
}
BERT_TEMPLATE = ("{cls}:0 $A:0 {sep}:0", "{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1")
UNIGRAM = 1  # sentencepiece_model.proto TrainerSpec.ModelType


def describe(tokenizer: Tokenizer) -> str:
    """One phrase for a model card, e.g. "WordPiece, 30,522 tokens, lowercased"."""
    case = ", lowercased" if getattr(tokenizer, "lowercase", False) else ""
    if isinstance(tokenizer, WordPieceTokenizer):
        return f"WordPiece, {tokenizer.vocab_size:,} tokens" + (case or ", cased")
    if isinstance(tokenizer, XLNetSentencePieceTokenizer):
        return f"XLNet's sentencepiece, {tokenizer.vocab_size:,} pieces{case}"
    if isinstance(tokenizer, AlbertSentencePieceTokenizer):
        return f"ALBERT's sentencepiece, {tokenizer.vocab_size:,} pieces{case}"
    if isinstance(tokenizer, SentencePieceTokenizer):
        return f"sentencepiece, {tokenizer.vocab_size:,} pieces"
    if isinstance(tokenizer, MosesBPETokenizer):
        return f"XLM's Moses + BPE, {tokenizer.vocab_size:,} tokens{case}"
    return f"byte-level BPE, {tokenizer.vocab_size:,} tokens"


def check(tokenizer: Tokenizer, model_type: str, vocab_size: int) -> None:
    """Refuses a tokenizer that `save` cannot write for a model of HF `model_type` with
    `vocab_size` embedding rows: one of another size (it is not the model's), or a
    sentencepiece model that is not unigram."""
    if not (tokenizer.vocab_size <= vocab_size if model_type == "t5"
            else tokenizer.vocab_size == vocab_size):
        raise UserError(f"the tokenizer has {tokenizer.vocab_size} ids but the model "
                        f"{vocab_size}; pass the model's own (run.py convert --tokenizer PATH)")
    if (isinstance(tokenizer, SentencePieceTokenizer)
            and _proto(tokenizer).trainer_spec.model_type != UNIGRAM):
        raise UserError(f"{tokenizer.model_file} is not a unigram sentencepiece model, which "
                        "is the only kind exported to HuggingFace; train with model_type=unigram")


def _proto(tokenizer: SentencePieceTokenizer) -> Any:
    from sentencepiece import sentencepiece_model_pb2

    return sentencepiece_model_pb2.ModelProto.FromString(Path(tokenizer.model_file).read_bytes())


def save(tokenizer: Tokenizer, directory: Path, model_type: str, vocab_size: int) -> None:
    """Writes `tokenizer`'s HF files into `directory` for a model of HF `model_type` with
    `vocab_size` embedding rows (T5's: the tokenizer's and the sentinels); see the module
    docstring. What `check` refuses is refused."""
    check(tokenizer, model_type, vocab_size)
    specials = _special_tokens(tokenizer)
    sentinels = ([f"<extra_id_{i}>" for i in range(vocab_size - tokenizer.vocab_size)][::-1]
                 if model_type == "t5" else [])
    tokenizer.save(directory)
    config: dict[str, Any] = {"tokenizer_class": _class_name(tokenizer, model_type), **specials}
    if isinstance(tokenizer, (WordPieceTokenizer, XLNetSentencePieceTokenizer,
                              AlbertSentencePieceTokenizer)):
        config["do_lower_case"] = tokenizer.lowercase
    if isinstance(tokenizer, AlbertSentencePieceTokenizer):
        config["keep_accents"] = tokenizer.keep_accents
    if isinstance(tokenizer, ByteLevelBPETokenizer):
        config["add_prefix_space"] = False
    if isinstance(tokenizer, MosesBPETokenizer):
        config.update(tokenizer.settings())
    if isinstance(tokenizer, XLNetSentencePieceTokenizer):
        config["additional_special_tokens"] = [
            t for t in ("<eop>", "<eod>") if tokenizer.id_to_token(
                tokenizer.processor.piece_to_id(t)) == t]
    if isinstance(tokenizer, SentencePieceTokenizer):
        backend = _sentencepiece_backend(tokenizer, model_type, specials)
        backend.add_special_tokens(sentinels)
        backend.save(str(directory / TOKENIZER_JSON))
    if sentinels:
        config["additional_special_tokens"] = sentinels
        config["added_tokens_decoder"] = {
            str(tokenizer.vocab_size + i): {"content": token, "special": True, "lstrip": False,
                                            "rstrip": False, "normalized": False,
                                            "single_word": False}
            for i, token in enumerate(sentinels)}
    (directory / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    (directory / SPECIAL_TOKENS_MAP).write_text(json.dumps(specials, indent=2) + "\n")


def _special_tokens(tokenizer: Tokenizer) -> dict[str, str]:
    """The HF special-token roles, as pretext's tokenizer has them; GPT-2's vocabulary has one
    end-of-text token, which is its bos, eos, unk (as in HF GPT-2) and pad (as in pretext). A
    role whose token a WordPiece vocabulary lacks is left out."""
    roles = {"pad_token": "pad_id", "unk_token": "unk_id", "cls_token": "cls_id",
             "sep_token": "sep_id", "mask_token": "mask_id", "bos_token": "cls_id",
             "eos_token": "eos_id"}
    if isinstance(tokenizer, ByteLevelBPETokenizer) and GPT2_EOT in tokenizer.vocab:
        roles = {role: roles[role] for role in ("bos_token", "eos_token", "unk_token",
                                                "pad_token")}
    specials = {}
    for role, attribute in roles.items():
        try:
            specials[role] = tokenizer.id_to_token(getattr(tokenizer, attribute))
        except UserError:  # WordPieceTokenizer.missing
            continue
    return specials


def _class_name(tokenizer: Tokenizer, model_type: str) -> str:
    if isinstance(tokenizer, WordPieceTokenizer):
        return WORDPIECE_CLASSES.get(model_type, "BertTokenizer")
    if isinstance(tokenizer, ByteLevelBPETokenizer):
        return "GPT2Tokenizer" if GPT2_EOT in tokenizer.vocab else "RobertaTokenizer"
    if isinstance(tokenizer, XLNetSentencePieceTokenizer):
        return "XLNetTokenizer"
    if isinstance(tokenizer, AlbertSentencePieceTokenizer):
        return "AlbertTokenizer"
    return "PreTrainedTokenizerFast"


def _sentencepiece_backend(tokenizer: SentencePieceTokenizer, model_type: str,
                           specials: dict[str, str]) -> Any:
    """The `tokenizers.Tokenizer` of a unigram sentencepiece model (convert_slow_tokenizer.py
    `SpmConverter`, `XLNetConverter`)."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    proto = _proto(tokenizer)
    xlnet = isinstance(tokenizer, XLNetSentencePieceTokenizer)
    pieces = [(p.piece, p.score - 100 if xlnet and _digit_comma(p.piece) else p.score)
              for p in proto.pieces]
    backend = Backend(models.Unigram(pieces, unk_id=proto.trainer_spec.unk_id,
                                     byte_fallback=False))
    spec = proto.normalizer_spec
    steps = [normalizers.Precompiled(spec.precompiled_charsmap)] if spec.precompiled_charsmap \
        else []
    prepend = "always" if spec.add_dummy_prefix else "never"
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend)
    if xlnet or isinstance(tokenizer, AlbertSentencePieceTokenizer):
        # prepro_utils.py preprocess_text (AlbertTokenizer's the same, accents optional), then
        # sentencepiece's own normalisation
        front = [normalizers.Replace("``", '"'), normalizers.Replace("''", '"')]
        if not getattr(tokenizer, "keep_accents", False):
            front += [normalizers.NFKD(), normalizers.StripAccents()]
        if tokenizer.lowercase:
            front.append(normalizers.Lowercase())
        steps = [*front, *steps, normalizers.Replace(Regex(" {2,}"), " ")]
        metaspace = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), metaspace])
    elif spec.remove_extra_whitespaces:
        steps += [normalizers.Strip(left=False, right=True),
                  normalizers.Replace(Regex(" {2,}"), "▁")]
    backend.normalizer = normalizers.Sequence(steps)
    backend.pre_tokenizer = metaspace
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=prepend)
    # Control symbols are special; user-defined ones are matched in text, as sentencepiece does.
    backend.add_tokens([AddedToken(p.piece, normalized=False, special=p.type == 3)
                        for p in proto.pieces if p.type in (3, 4)])
    template = TEMPLATES.get(model_type, BERT_TEMPLATE)
    if template is not None:
        backend.post_processor = _template(template, specials, tokenizer)
    return backend


def _template(template: tuple[str, str], specials: dict[str, str],
              tokenizer: SentencePieceTokenizer) -> Any:
    from tokenizers import processors

    names = {"cls": specials["cls_token"], "sep": specials["sep_token"],
             "eos": specials["eos_token"]}
    single, pair = (t.format(**names) for t in template)
    used = {token for name, token in names.items() if f"{{{name}}}" in template[1]}
    return processors.TemplateProcessing(
        single=single, pair=pair,
        special_tokens=[(token, tokenizer.processor.piece_to_id(token)) for token in used])


def _digit_comma(piece: str) -> bool:
    """A piece that XLNet's prepro_utils.py `encode_pieces` splits (convert_slow_tokenizer.py
    `check_number_comma`, negated)."""
    return len(piece) > 1 and piece[-1] == "," and piece[-2].isdigit()
