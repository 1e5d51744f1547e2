"""A deterministic synthetic chat corpus a tiny model can learn (bundled sample + quickstart data).

Conversations are templated over a small word set with answers that follow from the question (arithmetic,
counting, spelling backwards, fixed facts, weather/calculator tool calls with JSON arguments and tool results,
multi-turn follow-ups), and most assistant turns carry a short reasoning section. Only ``random.Random(seed)`` is
used, so the same ``(n, seed)`` gives the same rows on every platform; the bundled file is
``generate_synthetic_corpus(SAMPLE_SIZE, SAMPLE_SEED)`` and a test checks it byte for byte.

Regenerate the bundled file with ``python -m lightning_eagle.commands.synthetic_corpus``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

SAMPLE_SIZE = 400
SAMPLE_SEED = 0
SAMPLE_FILE_NAME = "synthetic_chat.jsonl"
# Shipped as package data; written by ``python -m lightning_eagle.commands.synthetic_corpus``.
BUNDLED_SAMPLE = Path(__file__).resolve().parents[1] / "assets" / "data" / SAMPLE_FILE_NAME

CITIES = ("Paris", "Rome", "Oslo", "Cairo", "Lima", "Tokyo")
CONDITIONS = ("sunny", "cloudy", "rainy", "windy")
WORDS = ("cat", "dog", "sun", "tree", "book", "lamp", "moon", "fish", "star", "cake")
FACTS = {
    "What color is the sky?": ("The sky is blue.", "Clear skies look blue."),
    "What color is grass?": ("Grass is green.", "Grass is green."),
    "What color is snow?": ("Snow is white.", "Snow is white."),
    "What sound does a dog make?": ("A dog says woof.", "Dogs bark: woof."),
    "What sound does a cat make?": ("A cat says meow.", "Cats meow."),
    "What sound does a cow make?": ("A cow says moo.", "Cows moo."),
}
GREETINGS = (("Hello!", "Hello! How can I help?"), ("Hi there.", "Hi! What do you need?"))
THANKS = (("Thanks!", "You are welcome."), ("Thank you.", "Glad to help."))


def _exchange(question: str, reasoning: str, answer: str) -> list[dict[str, Any]]:
    """One user question and the assistant's reasoned answer (the keys in this order: the bundled file's bytes)."""
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "reasoning_content": reasoning, "content": answer},
    ]


def _arithmetic(rng: random.Random) -> list[dict[str, Any]]:
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    op = rng.choice(("plus", "minus", "times"))
    if op == "minus" and b > a:
        a, b = b, a
    result = {"plus": a + b, "minus": a - b, "times": a * b}[op]
    sign = {"plus": "+", "minus": "-", "times": "*"}[op]
    return _exchange(f"What is {a} {op} {b}?", f"{a} {op} {b} is {result}.", f"{a} {sign} {b} = {result}.")


def _counting(rng: random.Random) -> list[dict[str, Any]]:
    start = rng.randint(1, 12)
    stop = start + rng.randint(2, 6)
    numbers = ", ".join(str(i) for i in range(start, stop + 1))
    return _exchange(f"Count from {start} to {stop}.", f"Start at {start}, stop at {stop}.", f"{numbers}.")


def _backwards(rng: random.Random) -> list[dict[str, Any]]:
    word = rng.choice(WORDS)
    letters = " ".join(word)
    return _exchange(f"Spell {word} backwards.", f"The letters are {letters}.", f"{word} backwards is {word[::-1]}.")


def _fact(rng: random.Random) -> list[dict[str, Any]]:
    question = rng.choice(sorted(FACTS))
    answer, reasoning = FACTS[question]
    return _exchange(question, reasoning, answer)


def _weather(rng: random.Random) -> list[dict[str, Any]]:
    city, condition = rng.choice(CITIES), rng.choice(CONDITIONS)
    temp = rng.randint(-5, 35)
    call_id = f"call_{rng.randint(100, 999)}"
    return [
        {"role": "user", "content": f"What is the weather in {city}?"},
        {
            "role": "assistant",
            "reasoning_content": f"I need the weather tool for {city}.",
            "content": "",
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": f"{city}: {temp}C, {condition}"},
        {
            "role": "assistant",
            "reasoning_content": f"The tool says {temp}C and {condition}.",
            "content": f"It is {temp}C and {condition} in {city}.",
        },
    ]


def _calculator(rng: random.Random) -> list[dict[str, Any]]:
    a, b = rng.randint(2, 30), rng.randint(2, 30)
    call_id = f"call_{rng.randint(100, 999)}"
    return [
        {"role": "user", "content": f"Use the calculator to multiply {a} by {b}."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "calculator", "arguments": {"op": "mul", "a": a, "b": b}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": str(a * b)},
        {"role": "assistant", "content": f"{a} times {b} is {a * b}."},
    ]


# Repeats weight the draw; tool conversations are the longest (XTML tool calls are verbose), so they are rarer.
TASKS: tuple[Callable[[random.Random], list[dict[str, Any]]], ...] = (
    _arithmetic,
    _arithmetic,
    _arithmetic,
    _counting,
    _counting,
    _backwards,
    _backwards,
    _fact,
    _fact,
    _weather,
    _calculator,
)
FOLLOW_UPS = (_arithmetic, _counting, _backwards, _fact)


def _conversation(rng: random.Random) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.15:
        messages.append({"role": "system", "content": "You are a concise assistant."})
    if rng.random() < 0.1:
        user, reply = rng.choice(GREETINGS)
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    messages += rng.choice(TASKS)(rng)
    if rng.random() < 0.15:  # a follow-up task in the same conversation
        messages += rng.choice(FOLLOW_UPS)(rng)
    if rng.random() < 0.1:
        user, reply = rng.choice(THANKS)
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return messages


def generate_synthetic_corpus(n: int = SAMPLE_SIZE, seed: int = SAMPLE_SEED) -> list[dict[str, Any]]:
    """``n`` conversations ``{"id", "messages"}``; identical for identical ``(n, seed)``."""
    rng = random.Random(seed)
    return [{"id": f"synthetic-{seed}-{i:05d}", "messages": _conversation(rng)} for i in range(n)]


def corpus_to_jsonl(rows: Iterable[dict[str, Any]]) -> str:
    """The exact serialization of the bundled file (one compact JSON object per line)."""
    return "".join(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n" for row in rows)


def write_synthetic_corpus(path: str | Path, n: int = SAMPLE_SIZE, seed: int = SAMPLE_SEED) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(corpus_to_jsonl(generate_synthetic_corpus(n, seed)), encoding="utf-8")
    return path


def bundled_sample_path() -> Path:
    """Path of the bundled sample corpus (``lightning_eagle/assets/data/synthetic_chat.jsonl``)."""
    path = BUNDLED_SAMPLE
    if not path.is_file():
        raise FileNotFoundError(
            f"bundled sample corpus missing at {path}; "
            "regenerate it with python -m lightning_eagle.commands.synthetic_corpus"
        )
    return path
