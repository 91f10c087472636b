"""A word-level tokenizer for the tiny model, built deterministically in code (no hub, no trainer).

Vocabulary (ids in this order): ``[PAD]=0, [UNK]=1, <bos>=2``, the prompt words, the characters
that may appear inside quotes, and finally ``<eos>`` with the HIGHEST id. Why last: the CLIP text
model pools the hidden state at the end token, and with a legacy ``eos_token_id == 2`` transformers
pools at ``argmax(input_ids)`` instead -- with ``<eos>`` highest both rules pick the end token.

Pre-tokenization: text outside double quotes splits into whitespace-separated words; text inside
quotes splits into single characters (so an unseen string like ``"73"`` is made of known tokens).
A character counts as "inside" when an odd number of ``"`` follow it (a regex lookahead), so the
rule lives in the saved ``tokenizer.json`` and survives ``save_pretrained``/``from_pretrained``.
"""

from __future__ import annotations

from typing import Iterable

PAD, UNK, BOS, EOS = "[PAD]", "[UNK]", "<bos>", "<eos>"

# One char inside quotes | a word outside quotes | a quote mark. Unmatched text (spaces outside
# quotes) is dropped (``invert=True`` keeps the matches as the pieces).
SPLIT_PATTERN = r'''[^"](?=[^"]*"(?:[^"]*"[^"]*")*[^"]*$)|[^\s"]+|"'''


def build_vocab(words: Iterable[str], charset: str) -> dict[str, int]:
    """Token -> id: specials, sorted unique words, quote mark, sorted unique chars, then ``<eos>``."""
    tokens = [PAD, UNK, BOS]
    seen = set(tokens) | {EOS}
    for tok in sorted(set(words)) + ['"'] + sorted(set(charset)):
        if tok and tok not in seen:
            seen.add(tok)
            tokens.append(tok)
    tokens.append(EOS)
    return {tok: i for i, tok in enumerate(tokens)}


def build_tokenizer(words: Iterable[str], charset: str, max_length: int):
    """A ``PreTrainedTokenizerFast`` that pads/truncates to ``max_length`` tokens incl. bos/eos.

    Call it as ``tok(prompts, padding="max_length", truncation=True, max_length=max_length,
    return_tensors="pt")`` (see ``tokenize``); unknown words map to ``[UNK]``.
    """
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = build_vocab(words, charset)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="removed", invert=True)
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {EOS}", special_tokens=[(BOS, vocab[BOS]), (EOS, vocab[EOS])])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, unk_token=UNK, pad_token=PAD,
        model_max_length=max_length, padding_side="right", truncation_side="right")


def tokenize(tokenizer, prompts: list[str], max_length: int | None = None):
    """Token ids ``(N, max_length)`` int64, padded with ``[PAD]`` after ``<eos>``.

    Truncation keeps ``<eos>`` as the last token (the template adds it after truncation), so the
    CLIP pooling always finds it.
    """
    max_length = max_length or tokenizer.model_max_length
    out = tokenizer(list(prompts), padding="max_length", truncation=True, max_length=max_length,
                    return_tensors="pt")
    return out["input_ids"]
