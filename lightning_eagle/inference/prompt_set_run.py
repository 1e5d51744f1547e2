"""Acceptance on a prompt set the way draft cards report it: every conversation decoded turn by turn, as served.

Turn i of a conversation is rendered (K3 XTML, generation prompt) after the user turns 1..i and the target's *own*
answers to turns 1..i−1 (:func:`~lightning_eagle.data.regenerate.k3_response.split_k3_response` turns each generated
answer back into the assistant message, thinking included), then decoded by speculative decoding. The verification
rounds of every turn pool into one :class:`~lightning_eagle.inference.acceptance.AcceptanceReport`; its numbers
(:func:`set_summary`) are what the command's table, JSON and plot and the callback's ``val/…`` metrics all show.

Acceptance against context length uses generated long prompts (:func:`context_length_prompts`), the recipe: for
each length L, chats of the bundled synthetic corpus strung into one conversation rendering to ``[L − 512, L]``
tokens (``lightning_eagle.data.long_corpus``), cut before its last assistant turn.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from lightning_eagle.data.prompt_sets import PromptSet
from lightning_eagle.inference.acceptance import (
    MAX_CONTEXT_LENGTH,
    MAX_EXTRAPOLATION,
    AcceptanceReport,
    beyond_target,
    check_prompt_ids,
    context_bounds,
    target_stop_ids,
)
from lightning_eagle.inference.decoding_settings import CARD_DECODING, DecodingSettings, check_decoding
from lightning_eagle.inference.draft_families import decoding_loop
from lightning_eagle.inference.speculative import SpeculativeOutput

# A generated long context lies this many tokens below its nominal length at most (long_corpus needs >= 512).
CONTEXT_LENGTH_SLACK = 512


@torch.no_grad()
def evaluate_prompt_set(
    target,
    draft,
    prompt_set: PromptSet,
    tokenizer,
    decoding: DecodingSettings = CARD_DECODING,
    *,
    render_options: dict[str, Any] | None = None,
    on_turn: Callable[[], None] | None = None,
) -> AcceptanceReport:
    """Speculative decoding of every turn of every conversation of ``prompt_set`` (module docstring) → one report.

    ``tokenizer``: the target's (a ``KimiTokenizer``); ``decoding``: how every turn is decoded
    (:class:`~lightning_eagle.inference.decoding_settings.DecodingSettings`; default the cards' sampling, temperature
    1 and top-p 0.95; ``num_draft_tokens=None``: the draft family's own K), each turn seeded ``seed + its index`` over
    the whole set; ``render_options``: ``thinking`` / ``thinking_effort`` as the draft was trained with. ``on_turn``
    is called after every decoded turn (a progress bar)."""
    from lightning_eagle.data.regenerate.k3_response import split_k3_response
    from lightning_eagle.data.render_k3 import render_k3_chat

    decoding = check_decoding(decoding, "evaluate_prompt_set").for_draft(draft)
    options = {"thinking": True, "thinking_effort": None, **(render_options or {})}
    check_prompt_set_fits(prompt_set, tokenizer, target.config, options)  # before the first turn is decoded
    stop = target_stop_ids(target)
    outputs: list[tuple[int, SpeculativeOutput]] = []
    with decoding_loop(draft) as generate:  # chains for EAGLE-3, blocks for DSpark; a training draft in eval mode
        for index, conversation in enumerate(prompt_set.conversations):
            messages: list[dict[str, Any]] = []
            for number, turn in enumerate(conversation, start=1):
                messages.append({"role": "user", "content": turn})
                prompt = render_k3_chat(messages, tokenizer, add_generation_prompt=True, **options)
                problem = beyond_target(len(prompt), target.config)  # the target's own answers made it longer
                if problem:
                    raise ValueError(
                        f"{conversation_name(prompt_set, index)}: turn {number} with the target's answers before it "
                        f"is {len(prompt)} tokens, {problem}"
                    )
                check_prompt_ids([prompt], target)
                out = decoding.run(generate, target, draft, prompt, len(outputs), stop)
                outputs.append((len(prompt), out))
                answer = split_k3_response(out.tokens, tokenizer, options["thinking"])
                messages.append(
                    {"role": "assistant", "content": answer.content, "reasoning_content": answer.reasoning_content}
                )
                if on_turn is not None:
                    on_turn()
    return AcceptanceReport.pooled(
        outputs,
        num_prompts=len(prompt_set.conversations),
        num_draft_tokens=decoding.num_draft_tokens,
        temperature=decoding.temperature,
        top_p=decoding.top_p,
        max_new_tokens=decoding.max_new_tokens,
    )


def conversation_name(prompt_set: PromptSet, index: int) -> str:
    """Conversation ``index`` of a set as a refusal names it: the set, the conversation's number, and for a user's
    file the file and line it came from."""
    where = ""
    if prompt_set.source is not None and prompt_set.lines is not None:
        where = f" ({prompt_set.source}:{prompt_set.lines[index]})"
    return f"prompt set {prompt_set.name!r}, conversation {index + 1}{where}"


def check_prompt_set_fits(
    prompt_set: PromptSet, tokenizer, config, render_options: dict[str, Any] | None = None
) -> int:
    """Refuse, before anything is decoded, a conversation whose user turns alone (no answers yet: the shortest its last
    turn's prompt can be) render to more tokens than a target of ``config`` holds even extrapolated
    (:func:`~lightning_eagle.inference.acceptance.context_bounds`); a ``ValueError`` naming the conversation. Returns
    the longest of these lengths (what the command compares with the target's declared length)."""
    from lightning_eagle.data.render_k3 import render_k3_chat

    options = {"thinking": True, "thinking_effort": None, **(render_options or {})}
    longest = 0
    for index, conversation in enumerate(prompt_set.conversations):
        messages = [{"role": "user", "content": turn} for turn in conversation]
        length = len(render_k3_chat(messages, tokenizer, add_generation_prompt=True, **options))
        longest = max(longest, length)
        problem = beyond_target(length, config)
        if problem:
            what = (
                "its prompt renders" if len(conversation) == 1 else f"its {len(conversation)} user turns alone render"
            )
            raise ValueError(f"{conversation_name(prompt_set, index)}: {what} to {length} tokens, {problem}; "
                             "shorten it or leave it out")  # fmt: skip
    return longest


def set_summary(report: AcceptanceReport) -> dict[str, Any]:
    """The numbers a draft card reports for one set, from one report: vLLM's mean acceptance length
    (``1 + accepted / drafts``), the conditional per-position acceptance P(draft j | 1..j−1 accepted), vLLM's
    per-position and draft acceptance rates, prompts, turns, tokens, the wall clock split draft vs target, and the
    confidence head's calibration per block position (:mod:`~lightning_eagle.inference.calibration`; None without
    a head, ``calibration_unavailable`` saying why when the loop knows)."""
    engine = report.engine
    spent = report.spec_draft_seconds + report.spec_target_seconds
    return {
        "mean_acceptance_length": engine["mean_acceptance_length"],
        "acceptance_per_position": report.acceptance_per_position,
        "per_position_acceptance_rate": engine["per_position_acceptance_rate"],
        "draft_acceptance_rate": engine["draft_acceptance_rate"],
        "prompts": report.num_prompts,
        "turns": report.num_turns,
        "rounds": report.num_rounds,
        "prompt_tokens": report.prompt_tokens,
        "generated_tokens": report.spec_tokens,
        "draft_seconds": report.spec_draft_seconds,
        "target_seconds": report.spec_target_seconds,
        "draft_time_share": report.spec_draft_seconds / spent if spent > 0 else math.nan,
        "num_draft_tokens": report.num_draft_tokens,
        "temperature": report.temperature,
        "top_p": report.top_p,
        "calibration": report.calibration,
        "calibration_unavailable": report.confidence_unavailable,
    }


def summary_metrics(prefix: str, summary: dict[str, Any]) -> dict[str, float]:
    """:func:`set_summary` as flat scalar metrics under ``prefix`` (``val/mt_bench``): the callback logs these."""
    metrics = {
        f"{prefix}/{key}": float(summary[key])
        for key in ("mean_acceptance_length", "draft_acceptance_rate", "draft_seconds", "target_seconds")
    }
    for k, rate in enumerate(summary["acceptance_per_position"]):
        if rate == rate:  # undefined positions (no round reached them) are not logged
            metrics[f"{prefix}/accept_{k}"] = float(rate)
    return metrics


def parse_context_lengths(text: str) -> list[int]:
    """``"1k,4k,16k"`` → ``[1024, 4096, 16384]`` (``k`` = 1024, plain integers as given); refuses a bad entry, a length
    past :data:`~lightning_eagle.inference.acceptance.MAX_CONTEXT_LENGTH` (no target is measured there) and a length
    given twice (each length is one row of the table and one key of the JSON)."""
    lengths: dict[int, str] = {}
    for word in (w.strip().lower() for w in text.split(",")):
        scale = 1024 if word.endswith("k") else 1
        digits = word[:-1] if scale > 1 else word
        if not (digits.isascii() and digits.isdigit()) or int(digits) * scale <= CONTEXT_LENGTH_SLACK:
            raise ValueError(
                f"--context-lengths: {word!r} is not a length above {CONTEXT_LENGTH_SLACK} tokens (like 1k, 4k, 16384)"
            )
        length = int(digits) * scale
        if length > MAX_CONTEXT_LENGTH:
            raise ValueError(
                f"--context-lengths: {word!r} is {length} tokens, beyond {MAX_CONTEXT_LENGTH // 1024}k "
                f"({MAX_CONTEXT_LENGTH}), the longest context measured on any target ({MAX_EXTRAPOLATION}x K3's "
                "declared max_position_embeddings, even with --allow-extrapolation)"
            )
        if length in lengths:
            same = "" if lengths[length] == word else f" (as {lengths[length]!r})"
            raise ValueError(
                f"--context-lengths names {word!r} ({length} tokens) more than once{same}: each length is measured "
                "once, one row of the table"
            )
        lengths[length] = word
    return list(lengths)


def check_context_lengths(lengths: list[int], config, allow_extrapolation: bool) -> None:
    """Refuse context lengths past a target of ``config``: past its ``max_position_embeddings`` unless
    ``allow_extrapolation``, and past what it is measured at even then (:func:`~lightning_eagle.inference.acceptance.
    context_bounds`); the messages name ``--context-lengths`` and the limit."""
    declared, most = context_bounds(config)
    too_long = [n for n in lengths if n > most]
    if too_long:
        raise ValueError(
            f"--context-lengths {too_long} exceed {most} tokens, the longest context this target is measured at even "
            f"with --allow-extrapolation ({MAX_EXTRAPOLATION}x its max_position_embeddings {declared})"
        )
    beyond = [n for n in lengths if n > declared]
    if beyond and not allow_extrapolation:
        raise ValueError(
            f"--context-lengths {beyond} exceed the target's max_position_embeddings {declared}: K3's layers (KDA, "
            "NoPE MLA) read no positions, so they would run, but beyond the length the target was declared for (up "
            f"to {most} tokens, {MAX_EXTRAPOLATION}x it, are measured with the flag); add --allow-extrapolation to "
            "measure them anyway"
        )


def context_length_prompts(
    length: int, num_prompts: int, tokenizer, seed: int = 0, render_options: dict[str, Any] | None = None
) -> list[list[int]]:
    """``num_prompts`` token prompts of at most ``length`` tokens (module docstring): each a long chat rendered with
    the generation prompt up to its last assistant turn, with the same render options as the run."""
    from lightning_eagle.data.long_corpus import generate_long_corpus
    from lightning_eagle.data.render_k3 import render_k3_chat

    options = {"thinking": True, "thinking_effort": None, **(render_options or {})}
    rows = generate_long_corpus(
        num_prompts, seed, min_tokens=length - CONTEXT_LENGTH_SLACK, max_tokens=length, tokenizer=tokenizer, **options
    )
    prompts = []
    for row in rows:
        messages = row["messages"]
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        prompts.append(render_k3_chat(messages[:last], tokenizer, add_generation_prompt=True, **options))
    return prompts
