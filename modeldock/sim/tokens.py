"""A fake tokenizer: deterministic token counts, prefix-cache block hashes and output words.

Text is cut into tokens of CHARS_PER_TOKEN characters (English averages about four
characters per token on Llama-3's tokenizer). Because tokens are fixed-width slices of
the text, two prompts that share a text prefix share the same leading tokens, which is
what prefix caching needs. A list of integers is taken as token ids, one token each.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

CHARS_PER_TOKEN = 4

# Output vocabulary: token i of a reply is WORDS[(seed + 7 * i) % 64]; 7 and 64 are coprime,
# so a reply only repeats after 64 tokens.
WORDS: tuple[str, ...] = (
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy",
    "dog", "while", "seven", "small", "robots", "count", "blue", "stars",
    "under", "quiet", "river", "lights", "and", "every", "green", "engine",
    "hums", "softly", "through", "long", "winter", "nights", "near", "old",
    "stone", "bridges", "where", "paper", "boats", "drift", "past", "sleepy",
    "harbors", "filled", "with", "bright", "lanterns", "that", "glow", "like",
    "tiny", "moons", "above", "calm", "water", "so", "travelers", "rest",
    "before", "morning", "bells", "ring", "across", "distant", "hills", "again",
)


@dataclass(frozen=True)
class Prompt:
    num_tokens: int
    block_hashes: tuple[int, ...]  # one per full block, each chained to the one before
    seed: int  # picks the reply's words


def text_prompt(text: str, block_size: int) -> Prompt:
    num_tokens = max(1, -(-len(text) // CHARS_PER_TOKEN))
    step = block_size * CHARS_PER_TOKEN
    hashes: list[int] = []
    previous = 0
    for i in range(num_tokens // block_size):
        previous = hash((previous, text[i * step : (i + 1) * step]))
        hashes.append(previous)
    return Prompt(num_tokens, tuple(hashes), zlib.crc32(text.encode("utf-8", "surrogatepass")))


def token_ids_prompt(ids: Sequence[int], block_size: int) -> Prompt:
    hashes: list[int] = []
    previous = 0
    for i in range(len(ids) // block_size):
        previous = hash((previous, tuple(ids[i * block_size : (i + 1) * block_size])))
        hashes.append(previous)
    seed = zlib.crc32(",".join(map(str, ids)).encode())
    return Prompt(max(1, len(ids)), tuple(hashes), seed)


def render_chat(messages: Sequence[dict[str, Any]]) -> str:
    """Messages as one text, in a Llama-3-like template.

    Each message costs its content plus the `<|role|>\\n...\\n` wrapper (about three tokens),
    and the reply's `<|assistant|>\\n` header is appended, as add_generation_prompt does.
    """
    parts: list[str] = []
    for message in messages:
        parts.append(f"<|{message.get('role', 'user')}|>\n{_content_text(message.get('content'))}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        # OpenAI content parts; only text parts carry tokens here.
        return "".join(
            str(part.get("text", "")) for part in content if isinstance(part, dict) and part.get("type") == "text"
        )
    return str(content)


def token_text(seed: int, index: int) -> str:
    word = WORDS[(seed + 7 * index) % len(WORDS)]
    return word if index == 0 else " " + word


def reply_text(seed: int, num_tokens: int) -> str:
    return "".join(token_text(seed, i) for i in range(num_tokens))
