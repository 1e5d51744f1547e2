"""Real acceptance of a DSpark block drafter on held-out prompts: the chain evaluation's report
(:class:`~lightning_eagle.inference.acceptance.AcceptanceReport`: τ, per-position acceptance, vLLM's mean acceptance
length, draft vs target wall-clock, the plain-decoding baseline) from :func:`~lightning_eagle.inference.
block_speculative.block_speculative_generate`, plus the analytic ``1 + Σ_k Π_{i≤k} (1 − TV_i)`` of the same rounds.

:func:`evaluate_block_acceptance` takes the arguments of :func:`~lightning_eagle.inference.acceptance.
evaluate_acceptance` but ``aux_layer_ids`` (a DSpark drafter records its taps), so a caller dispatches on the draft
family with one set of keyword arguments.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_eagle.inference.acceptance import AcceptanceReport, capped_prompts
from lightning_eagle.inference.block_speculative import analytic_tau, block_speculative_generate, check_drafter
from lightning_eagle.inference.incremental_target import DEFAULT_PREFILL_CHUNK, check_prefill_chunk
from lightning_eagle.inference.plain import plain_generate

log = logging.getLogger(__name__)


@dataclass
class BlockAcceptanceReport(AcceptanceReport):
    """An :class:`~lightning_eagle.inference.acceptance.AcceptanceReport` of block rounds, with each round's total
    variations per drafted position (``tv_per_round``) and their analytic τ."""

    tv_per_round: list[list[float]] = field(default_factory=list, repr=False)

    @property
    def tau_analytic(self) -> float:
        """Mean over rounds of ``1 + Σ_k Π_{i≤k} (1 − TV_i)``: the τ rejection sampling expects from the measured
        distributions (:func:`~lightning_eagle.inference.block_speculative.analytic_tau`)."""
        return analytic_tau(self.tv_per_round)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "tau_analytic": self.tau_analytic}

    def format(self) -> str:
        return super().format() + f"\ntau_analytic (1 + sum_k prod (1 - TV_i))  {self.tau_analytic:.3f}"


@torch.no_grad()
def evaluate_block_acceptance(
    target,
    drafter,
    data=None,
    *,
    tokenizer=None,
    num_prompts: int = 16,
    max_new_tokens: int = 64,
    num_draft_tokens: int | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    stop_token_ids: Iterable[int] | str | None = "eos",
    compare_plain: bool = True,
    warmup: bool = True,
    thinking: bool = True,
    thinking_effort: str | None = None,
    max_prompt_tokens: int | None = None,
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
) -> BlockAcceptanceReport:
    """Block speculative decoding over held-out prompts → :class:`BlockAcceptanceReport`. ``data`` and every
    keyword are those of :func:`~lightning_eagle.inference.acceptance.evaluate_acceptance`; ``num_draft_tokens``
    None = the drafter's block size. Prompt ``i`` is decoded with seed ``seed + i`` by both decodings."""
    check_drafter(target, drafter)
    check_prefill_chunk(prefill_chunk)
    render_options = {"thinking": thinking, "thinking_effort": thinking_effort}
    prompts = capped_prompts(data, tokenizer, num_prompts, render_options, max_prompt_tokens)
    if not prompts:
        capped = "" if max_prompt_tokens is None else f" of at most max_prompt_tokens={max_prompt_tokens} tokens"
        raise ValueError(f"no prompts{capped}: the data holds no such conversation with an assistant turn")
    if len(prompts) < num_prompts and max_prompt_tokens is not None:
        log.warning("evaluate_block_acceptance: only %d of num_prompts=%d prompts fit", len(prompts), num_prompts)
    vocab = target.config.vocab_size
    too_big = max(max(p) for p in prompts)
    if too_big >= vocab:
        raise ValueError(f"prompt token id {too_big} >= target vocab_size {vocab}: tokenizer and target differ")
    if stop_token_ids == "eos":
        eos = getattr(target.config, "eos_token_id", None)
        stop_token_ids = [] if eos is None else [eos]
    common = {"stop_token_ids": stop_token_ids, "prefill_chunk": prefill_chunk}
    was_training = drafter.training
    drafter.eval()
    try:
        if warmup:
            block_speculative_generate(target, drafter, prompts[0], 4, num_draft_tokens, temperature, seed, **common)
            if compare_plain:
                plain_generate(target, prompts[0], 4, temperature, seed, **common)
        spec = [
            block_speculative_generate(
                target, drafter, p, max_new_tokens, num_draft_tokens, temperature, seed + i, **common
            )
            for i, p in enumerate(prompts)
        ]
        plain = [
            plain_generate(target, p, max_new_tokens, temperature, seed + i, **common)
            for i, p in enumerate(prompts)
            if compare_plain
        ]
    finally:
        drafter.train(was_training)
    return BlockAcceptanceReport(
        num_prompts=len(prompts),
        num_draft_tokens=spec[0].num_draft_tokens,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        accepted_per_round=[a for out in spec for a in out.accepted_per_round],
        spec_tokens=sum(len(out.tokens) for out in spec),
        spec_seconds=sum(out.seconds for out in spec),
        spec_target_seconds=sum(out.target_seconds for out in spec),
        spec_draft_seconds=sum(out.draft_seconds for out in spec),
        spec_target_forwards=sum(out.target_forwards for out in spec),
        plain_tokens=sum(len(ref.tokens) for ref in plain) if compare_plain else None,
        plain_seconds=sum(ref.seconds for ref in plain) if compare_plain else None,
        plain_target_forwards=sum(ref.target_forwards for ref in plain) if compare_plain else None,
        greedy_mismatches=sum(ref.tokens != out.tokens for ref, out in zip(plain, spec))
        if compare_plain and temperature == 0
        else None,
        tv_per_round=[tvs for out in spec for tvs in out.tv_per_round],
    )
