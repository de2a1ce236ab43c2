"""Deterministic prompts of an approximate length.

Length: one word is counted as about one token. The words below are short,
common English words that are a single token in the usual BPE vocabularies,
so `--prompt-tokens N` gives a prompt of N words, which is roughly N tokens
(each word carries a leading space, which these tokenizers fold into the word;
the chat template adds a few tokens on top). Use the server's `usage.prompt_tokens`
(`--usage`) when the exact count matters.

Variation: every request gets a different prompt (same length, different
words, and a distinct first word), derived from the request's index with a
fixed seed. Identical prompts would let a server's prefix cache skip prefill
and flatter TTFT; `shared=True` turns the variation off on purpose.
"""

from __future__ import annotations

import random

WORDS: tuple[str, ...] = tuple(
    """
    the of and to in is was for on that with as it by at from his an are
    have this had not but be or which one all were they their there been has
    more when who will would can if no out so what up said about into than
    them only other new some could time these two may then first any like
    now my such over our man me even most made after also did many before
    must through back years where much your way well down should because
    each just those people how too little state good very make world still
    own see men work long get here between both life being under never day
    same another know while last might us great old year off come since
    against go came right used take three
    """.split()
)

_SEED = 20240611


def build_prompt(tokens: int, variant: int = 0, *, shared: bool = False) -> str:
    """About `tokens` tokens of words; the same (tokens, variant) gives the same text."""
    if tokens < 1:
        raise ValueError("a prompt needs at least one token")
    seed = _SEED if shared else _SEED + variant
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(tokens)]
    if not shared:
        # A first word unique to the request defeats prefix caching from token 0.
        words[0] = f"r{variant}"
    return " ".join(words)
