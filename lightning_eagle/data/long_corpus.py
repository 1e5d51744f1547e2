"""Long synthetic conversations for long-context tests: many learnable turns of the synthetic corpus in one chat, each
chat's rendered length (K3 XTML, generation prompt off, the tokenizer and render options the data module uses) drawn
in ``[min_tokens, max_tokens]``.

Every turn is a task of :mod:`lightning_eagle.data.synthetic_corpus` (arithmetic, counting, spelling, facts), so a
tiny model still has something to learn at every position, and supervised tokens are spread over the whole row. Only
``random.Random(seed)`` is drawn from: the same arguments give the same rows on every platform.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from lightning_eagle.data.synthetic_corpus import FOLLOW_UPS, corpus_to_jsonl

# Rendered lengths are measured every this many added turns (a render of a 16K-token chat costs milliseconds).
_MEASURE_EVERY = 8


def rendered_length(messages: list[dict[str, Any]], tokenizer: Any, **render_options: Any) -> int:
    """Tokens of ``messages`` as the data pipeline renders them (K3 XTML or K2, generation prompt off), uncut.
    ``tokenizer``: a tokenizer or what ``data.tokenizer`` accepts (``"synthetic"``, a directory)."""
    from lightning_eagle.data.tokenizer_choice import resolve_tokenizer

    return _Measure(resolve_tokenizer(tokenizer), render_options)(messages)


class _Measure:
    """Rendered length with the pipeline's segments; short segments' ids memoized (exact: the tokenizer encodes
    segment by segment, as :class:`~lightning_eagle.data.encoding.RowEncoder` relies on too)."""

    def __init__(self, tokenizer: Any, render_options: dict[str, Any]) -> None:
        self.tokenizer, self.options, self.memo = tokenizer, dict(render_options), {}

    def __call__(self, messages: list[dict[str, Any]]) -> int:
        if getattr(self.tokenizer, "chat_format", "k3") == "k2":
            from lightning_eagle.data.render_k2 import build_k2_segments

            segments = build_k2_segments(messages, None, thinking=bool(self.options.get("thinking", False)))
        else:
            from lightning_eagle.data.render_k3 import build_k3_segments

            segments = build_k3_segments(messages, None, add_generation_prompt=False, **self.options)
        total = 0
        for segment in segments:
            key = (segment[0], bool(segment[1]))
            if key[0] and key not in self.memo:
                self.memo[key] = len(self.tokenizer.encode(key[0], allow_special_tokens=key[1]))
            total += self.memo.get(key, 0)
        return total


def _long_chat(rng: random.Random, target: int, max_tokens: int, measure) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a concise assistant."}]
    turns = 0
    while True:
        messages += rng.choice(FOLLOW_UPS)(rng)
        turns += 1
        if turns % _MEASURE_EVERY == 0 and measure(messages) >= target:
            break
    while measure(messages) > max_tokens:  # overshoot by up to _MEASURE_EVERY turns: drop whole exchanges
        messages = messages[:-2]
    return messages


def generate_long_corpus(
    n: int,
    seed: int = 0,
    *,
    min_tokens: int = 8192,
    max_tokens: int = 16384,
    tokenizer: Any = "synthetic",
    thinking: bool = True,
    thinking_effort: str | None = None,
) -> list[dict[str, Any]]:
    """``n`` chats ``{"id", "messages"}`` whose rendered length lies in ``[min_tokens, max_tokens]``.

    ``tokenizer`` (a name such as ``"synthetic"``, a directory or a tokenizer object) and ``thinking`` /
    ``thinking_effort`` must be the data module's: the length is measured with them. Each chat's target length is
    drawn uniformly in the range, so the rows have mixed lengths.
    """
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    # one exchange renders to ~100 tokens with a byte tokenizer: a narrower range might not hold any length
    if not 0 < min_tokens or max_tokens < min_tokens + 512:
        raise ValueError(f"need 0 < min_tokens and max_tokens >= min_tokens + 512, got {min_tokens}, {max_tokens}")
    from lightning_eagle.data.tokenizer_choice import resolve_tokenizer

    tok = resolve_tokenizer(tokenizer)
    options = {"thinking": thinking, "thinking_effort": thinking_effort}

    measure = _Measure(tok, options)
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        target = rng.randint(min_tokens, max_tokens)
        messages = _long_chat(rng, target, max_tokens, measure)
        if measure(messages) < min_tokens:
            raise RuntimeError(f"long chat {i} renders below {min_tokens} tokens: widen [min_tokens, max_tokens]")
        rows.append({"id": f"long-{seed}-{i:05d}", "messages": messages})
    return rows


def write_long_corpus(path: str | Path, n: int, seed: int = 0, **options: Any) -> Path:
    """Write :func:`generate_long_corpus` ``(n, seed, **options)`` as JSONL to ``path`` (parents created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(corpus_to_jsonl(generate_long_corpus(n, seed, **options)), encoding="utf-8")
    return path
