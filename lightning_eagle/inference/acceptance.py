"""Real acceptance length: run speculative decoding on held-out chat prompts and report τ, per-position acceptance
and throughput against plain decoding measured in the same run. One evaluation for every draft family: each prompt
is decoded by the loop of the draft's family (:func:`~lightning_eagle.inference.draft_families.generate_for`: chains
for EAGLE-3, blocks for DSpark).

Prompts (:mod:`lightning_eagle.data.prompts`) are conversations up to an assistant turn, rendered with the
generation prompt (what a K3 server sees). The report pools all verification rounds of all prompts:

* ``tau`` = mean(accepted + 1) over rounds = tokens per verification forward (comparable to training's τ_sim);
* ``acceptance_at_least[j−1]`` = share of rounds accepting ≥ j drafts (so ``tau = 1 + Σ_j acceptance_at_least``
  when every round drafts K) and ``acceptance_per_position[j−1]`` = P(draft j accepted | drafts 1..j−1 accepted);
* vLLM's definitions (``vllm/v1/spec_decode/metrics.py``, its "SpecDecoding metrics" log line and the
  ``vllm:spec_decode_*`` counters), computed by :func:`engine_acceptance` from the same rounds: ``mean acceptance
  length`` = 1 + accepted / drafts (= ``tau`` when every round drafts K), ``per-position acceptance rate[j−1]`` =
  accepted at position j / drafts (unconditional, unlike ``acceptance_per_position``), ``draft acceptance rate`` =
  accepted / drafted tokens;
* throughput: generated tokens per second of speculative decoding (wall, draft included), per second of its target
  forwards only, and of plain target-only decoding over the same prompts; ``speedup`` is their ratio on this
  machine. At temperature 0 the two outputs must agree token for token (``greedy_mismatches`` counts prompts that
  did not — 0 unless something is broken or two logits tie to fp32 rounding);
* ``tau_analytic`` = mean over rounds of ``1 + Σ_k Π_{i≤k} (1 − TV_i)``, where the loop measures each drafted
  position's total variation between draft and target (the block loop; nan for chains): the τ rejection sampling
  expects from the measured distributions, next to the measured ``tau``;
* ``calibration``: where the draft has a confidence head (DSpark's), the ECE per block position of its predicted
  acceptance against the observed one, cumulative (DeepSpec's) and conditional
  (:func:`~lightning_eagle.inference.calibration.position_calibration`); None without confidences, and
  ``confidence_unavailable`` says why when the loop knows (an export without its head).

Long prompts: ``max_prompt_tokens`` skips prompts longer than the cap (each costs a target prefill of its length);
those kept are prefilled ``prefill_chunk`` tokens per forward by both decodings, so memory grows linearly with the
prompt (:func:`~lightning_eagle.inference.speculative_generate`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_eagle.atomic import atomic_file
from lightning_eagle.data.prompts import resolve_prompts
from lightning_eagle.inference.calibration import position_calibration
from lightning_eagle.inference.decoding_settings import DEFAULT_DECODING, DecodingSettings, check_decoding
from lightning_eagle.inference.draft_families import decoding_loop
from lightning_eagle.inference.speculative import SpeculativeOutput, VerificationRounds
from lightning_eagle.settings import check_positive_int_or_none

log = logging.getLogger(__name__)


@dataclass
class AcceptanceReport(VerificationRounds):
    """All verification rounds of all prompts pooled, with the timings of both decodings (module docstring)."""

    num_prompts: int
    num_draft_tokens: int
    temperature: float
    max_new_tokens: int
    accepted_per_round: list[int] = field(repr=False)
    spec_tokens: int
    spec_seconds: float
    spec_target_seconds: float
    spec_draft_seconds: float
    spec_target_forwards: int
    plain_tokens: int | None = None
    plain_seconds: float | None = None
    plain_target_forwards: int | None = None
    greedy_mismatches: int | None = None
    top_p: float = 1.0
    prompt_tokens: int = 0  # tokens of every prompt decoded (each turn's rendered conversation, for multi-turn sets)
    num_turns: int = 0  # prompts decoded: num_prompts, or more for multi-turn sets (one per user turn)
    # per round, each drafted position's total variation (block drafting measures it; empty for chains)
    tv_per_round: list[list[float]] = field(default_factory=list, repr=False)
    # per round, a confidence head's per-slot predicted acceptance (empty without a head), and why none was recorded
    confidence_per_round: list[list[float]] = field(default_factory=list, repr=False)
    confidence_unavailable: str | None = None

    @classmethod
    def pooled(cls, outputs: list[tuple[int, SpeculativeOutput]], **settings: Any) -> AcceptanceReport:
        """The speculative side of a report from ``(prompt length, output)`` pairs; ``settings``: the other fields,
        ``num_draft_tokens`` replaced by the K the loops ran when there is an output (a block loop's g for None)."""
        if outputs:
            settings["num_draft_tokens"] = outputs[0][1].num_draft_tokens
        return cls(
            accepted_per_round=[a for _, out in outputs for a in out.accepted_per_round],
            spec_tokens=sum(len(out.tokens) for _, out in outputs),
            spec_seconds=sum(out.seconds for _, out in outputs),
            spec_target_seconds=sum(out.target_seconds for _, out in outputs),
            spec_draft_seconds=sum(out.draft_seconds for _, out in outputs),
            spec_target_forwards=sum(out.target_forwards for _, out in outputs),
            prompt_tokens=sum(length for length, _ in outputs),
            num_turns=len(outputs),
            tv_per_round=[tvs for _, out in outputs for tvs in out.tv_per_round],
            confidence_per_round=[cs for _, out in outputs for cs in out.confidence_per_round],
            confidence_unavailable=next(
                (o.confidence_unavailable for _, o in outputs if o.confidence_unavailable), None
            ),
            **settings,
        )

    @property
    def acceptance_at_least(self) -> list[float]:
        n = max(self.num_rounds, 1)
        return [sum(a >= j for a in self.accepted_per_round) / n for j in range(1, self.num_draft_tokens + 1)]

    @property
    def acceptance_per_position(self) -> list[float]:
        rates = []
        for j in range(1, self.num_draft_tokens + 1):
            reached = sum(a >= j - 1 for a in self.accepted_per_round)
            rates.append(sum(a >= j for a in self.accepted_per_round) / reached if reached else float("nan"))
        return rates

    @property
    def engine(self) -> dict[str, Any]:
        """vLLM's definitions over the same rounds (:func:`engine_acceptance`): a round is one draft of K tokens."""
        K = self.num_draft_tokens
        per_position = [sum(a >= j for a in self.accepted_per_round) for j in range(1, K + 1)]
        return engine_acceptance(self.num_rounds, K * self.num_rounds, per_position)

    @property
    def calibration(self) -> dict[str, Any] | None:
        """The confidence head's calibration per block position (module docstring); None without confidences."""
        return position_calibration(self.confidence_per_round, self.accepted_per_round)

    @property
    def spec_tokens_per_s(self) -> float:
        return self.spec_tokens / self.spec_seconds if self.spec_seconds > 0 else float("nan")

    @property
    def spec_tokens_per_target_s(self) -> float:
        return self.spec_tokens / self.spec_target_seconds if self.spec_target_seconds > 0 else float("nan")

    @property
    def plain_tokens_per_s(self) -> float:
        if not self.plain_seconds:
            return float("nan")
        return self.plain_tokens / self.plain_seconds

    @property
    def speedup(self) -> float:
        """Wall-clock tokens/s of speculative over plain decoding (nan without the plain run)."""
        return self.spec_tokens_per_s / self.plain_tokens_per_s

    @property
    def target_speedup(self) -> float:
        """The same ratio counting only the speculative run's target time: the speed-up of a free draft."""
        return self.spec_tokens_per_target_s / self.plain_tokens_per_s

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for name in (
            "num_rounds",
            "tau",
            "tau_analytic",
            "acceptance_at_least",
            "acceptance_per_position",
            "engine",
            "calibration",
            "spec_tokens_per_s",
            "spec_tokens_per_target_s",
            "plain_tokens_per_s",
            "speedup",
            "target_speedup",
        ):
            data[name] = getattr(self, name)
        return data

    def format(self) -> str:
        """A short human-readable table."""

        def fmt(x) -> str:
            return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"

        lines = [
            f"prompts {self.num_prompts}, rounds {self.num_rounds}, K {self.num_draft_tokens}, "
            f"temperature {self.temperature}, top_p {self.top_p}, max_new_tokens {self.max_new_tokens}",
            f"tau_real (tokens per target forward)   {fmt(self.tau)}",
            "P(accept draft j | 1..j-1 accepted)    " + " ".join(fmt(r) for r in self.acceptance_per_position),
            "P(accepted >= j)                       " + " ".join(fmt(r) for r in self.acceptance_at_least),
            f"vLLM: mean acceptance length           {fmt(self.engine['mean_acceptance_length'])}",
            "vLLM: per-position acceptance rate     "
            + " ".join(fmt(r) for r in self.engine["per_position_acceptance_rate"]),
            f"vLLM: draft acceptance rate            {fmt(self.engine['draft_acceptance_rate'])}",
            f"speculative tokens/s (wall)            {fmt(self.spec_tokens_per_s)}",
            f"speculative tokens/s (target time)     {fmt(self.spec_tokens_per_target_s)}",
            f"plain decoding tokens/s                {fmt(self.plain_tokens_per_s)}",
            f"speed-up (wall) / (target only)        {fmt(self.speedup)} / {fmt(self.target_speedup)}",
        ]
        if self.greedy_mismatches is not None:
            lines.append(f"greedy mismatches vs plain decoding    {self.greedy_mismatches}")
        if self.tv_per_round:
            lines.append(f"tau_analytic (1 + sum_k prod (1 - TV_i))  {fmt(self.tau_analytic)}")
        calibration = self.calibration
        if calibration is not None:
            bins = calibration["bins"]
            for name, label in (("cumulative", "prod c_1..c_j vs 1..j accepted"), ("conditional", "c_j vs j | 1..j-1")):
                ece = calibration[name]["ece_per_position"]
                lines.append(f"confidence ECE ({label}, {bins} bins)  " + " ".join(fmt(e) for e in ece))
        elif self.confidence_unavailable:
            lines.append(f"confidence calibration unavailable: {self.confidence_unavailable}")
        return "\n".join(lines)


def engine_acceptance(drafts: int, draft_tokens: int, accepted_per_position: list[int]) -> dict[str, Any]:
    """vLLM's acceptance numbers from its three counters (``vllm:spec_decode_num_drafts``, ``…_num_draft_tokens``,
    ``…_num_accepted_tokens_per_pos``), as its ``SpecDecoding metrics`` log line prints them."""
    accepted = sum(accepted_per_position)
    nan = float("nan")
    return {
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else nan,
        "per_position_acceptance_rate": [a / drafts if drafts else nan for a in accepted_per_position],
        "draft_acceptance_rate": accepted / draft_tokens if draft_tokens else nan,
    }


# ---- evaluation -----------------------------------------------------------------------------------------------------
def check_max_prompt_tokens(max_prompt_tokens: int | None) -> int | None:
    """``max_prompt_tokens``: the longest prompt kept (a positive int) or None (no cap of our own)."""
    return check_positive_int_or_none(
        "max_prompt_tokens", max_prompt_tokens, "the longest prompt kept, in tokens", "no cap"
    )


def capped_prompts(
    data, tokenizer, num_prompts: int | None, render_options: dict[str, Any], max_prompt_tokens: int | None = None
) -> list[list[int]]:
    """The first ``num_prompts`` prompts of ``data`` (as :func:`~lightning_eagle.data.prompts.resolve_prompts`) of at
    most ``max_prompt_tokens`` tokens. A ``ChatDataModule`` applies its own ``max_length`` when the cap is None."""
    check_max_prompt_tokens(max_prompt_tokens)
    return resolve_prompts(data, tokenizer, num_prompts, render_options, max_prompt_tokens)


# K3 reads no positions (KDA, NoPE MLA), so a target runs past the length its config declares; but every prompt is
# one prefill of its length and a K/V cache that grows with it. The longest context measured on a target is this many
# times its max_position_embeddings (``--allow-extrapolation`` goes up to it, never past it); K3 declares 1M tokens
# (what counts when a config declares nothing), so no target is measured past 16M tokens.
MAX_EXTRAPOLATION = 16
K3_DECLARED_CONTEXT = 1_048_576
MAX_CONTEXT_LENGTH = MAX_EXTRAPOLATION * K3_DECLARED_CONTEXT


def context_bounds(config) -> tuple[int, int]:
    """``(declared, most)``: a target config's ``max_position_embeddings`` (K3's 1M when it has none) and the longest
    context measured on it even extrapolated (:data:`MAX_EXTRAPOLATION` times that)."""
    declared = getattr(config, "max_position_embeddings", None) or K3_DECLARED_CONTEXT
    return declared, MAX_EXTRAPOLATION * declared


def beyond_target(length: int, config) -> str | None:
    """Why a prompt of ``length`` tokens is refused on a target of ``config`` (None: it fits): the words after "is N
    tokens" in every such refusal."""
    declared, most = context_bounds(config)
    if length <= most:
        return None
    return (
        f"beyond {most} tokens, the longest context this target is measured at even extrapolated ({MAX_EXTRAPOLATION}x "
        f"its max_position_embeddings {declared})"
    )


def check_prompt_ids(prompts: list[list[int]], target) -> None:
    """Every prompt no longer than the target holds even extrapolated (:func:`context_bounds`) and every token id of
    ``prompts`` inside the target's vocabulary (one larger: the tokenizer is another model's)."""
    for i, prompt in enumerate(prompts):
        problem = beyond_target(len(prompt), target.config)
        if problem:
            raise ValueError(f"prompt {i + 1} is {len(prompt)} tokens, {problem}: skip longer prompts with "
                             "max_prompt_tokens")  # fmt: skip
    vocab, largest = target.config.vocab_size, max(max(p) for p in prompts)
    if largest >= vocab:
        raise ValueError(f"prompt token id {largest} >= target vocab_size {vocab}: tokenizer and target differ")


def target_stop_ids(target) -> list[int]:
    """The target's ``eos_token_id`` as a stop list (K3's ``<|end_of_msg|>``; empty when the config has none)."""
    eos = getattr(target.config, "eos_token_id", None)
    return [] if eos is None else [eos]


@torch.no_grad()
def evaluate_acceptance(
    target,
    draft,
    data=None,
    decoding: DecodingSettings = DEFAULT_DECODING,
    *,
    tokenizer=None,
    num_prompts: int = 16,
    stop_token_ids: Iterable[int] | str | None = "eos",
    compare_plain: bool = True,
    warmup: bool = True,
    thinking: bool = True,
    thinking_effort: str | None = None,
    max_prompt_tokens: int | None = None,
) -> AcceptanceReport:
    """Speculative decoding over held-out prompts → :class:`AcceptanceReport` (see the module docstring).

    Args:
        data: None = held-out chats of the bundled corpus; a JSONL/JSON chat file; a ``ChatDataModule`` (its
            validation split); a list of chats; or a list of token-id prompts.
        decoding: how every prompt is decoded (:class:`~lightning_eagle.inference.decoding_settings.DecodingSettings`:
            max new tokens, K, temperature, top-p, seed, taps, prefill chunk; default greedy, K 7, 64 new tokens).
            Its ``num_draft_tokens=None`` is the draft family's own K (an EAGLE-3 export's recorded ``ttt_steps``, a
            DSpark drafter's block); a DSpark drafter drafts at most its ``block_size`` g per round. At temperature
            > 0 both decodings sample the target's top-p nucleus (lossless w.r.t. it); ``prefill_chunk=None`` puts
            the whole prompt in one forward (memory then has ``[T,T]`` transients wherever an eager attention core
            runs). Prompt i is seeded ``seed + i``.
        tokenizer: for chats (default: the synthetic K3 tokenizer; a path or ``KimiTokenizer`` for real data).
        stop_token_ids: ``"eos"`` = the target's ``eos_token_id`` (K3's ``<|end_of_msg|>``), None = never stop.
        compare_plain: also decode every prompt with the target alone (throughput baseline; at temperature 0 also a
            losslessness check).
        warmup: one short untimed run first (allocator / first-call costs are not decoding speed).
        thinking / thinking_effort: render options for chats (as in training).
        max_prompt_tokens: prompts longer than this are skipped (the first ``num_prompts`` that fit are used); None
            = no cap (a ``ChatDataModule``'s prompts: its ``max_length``). Each prompt costs one target prefill of
            its length in both decodings; raises when no prompt fits.
    """
    # K filled in for this draft; each family's loop checks it (any K for chains, at most g for blocks)
    decoding = check_decoding(decoding, "evaluate_acceptance").for_draft(draft)
    render_options = {"thinking": thinking, "thinking_effort": thinking_effort}
    prompts = capped_prompts(data, tokenizer, num_prompts, render_options, max_prompt_tokens)
    if not prompts:
        capped = "" if max_prompt_tokens is None else f" of at most max_prompt_tokens={max_prompt_tokens} tokens"
        raise ValueError(f"no prompts{capped}: the data holds no such conversation with an assistant turn")
    if len(prompts) < num_prompts and max_prompt_tokens is not None:
        log.warning(
            "evaluate_acceptance: only %d of num_prompts=%d prompts fit max_prompt_tokens=%d",
            len(prompts),
            num_prompts,
            max_prompt_tokens,
        )
    check_prompt_ids(prompts, target)
    stop = target_stop_ids(target) if stop_token_ids == "eos" else stop_token_ids
    greedy = decoding.temperature == 0
    with decoding_loop(draft) as generate:  # chains for EAGLE-3, blocks for DSpark
        if warmup:
            short = dataclasses.replace(decoding, max_new_tokens=4)
            short.run(generate, target, draft, prompts[0], 0, stop)
            if compare_plain:
                short.run_plain(target, prompts[0], 0, stop)
        outputs: list[tuple[int, SpeculativeOutput]] = []
        plain = {"tokens": 0, "seconds": 0.0, "forwards": 0}
        mismatches = 0
        for i, prompt in enumerate(prompts):
            out = decoding.run(generate, target, draft, prompt, i, stop)
            outputs.append((len(prompt), out))
            if compare_plain:
                ref = decoding.run_plain(target, prompt, i, stop)
                plain["tokens"] += len(ref.tokens)
                plain["seconds"] += ref.seconds
                plain["forwards"] += ref.target_forwards
                mismatches += int(greedy and ref.tokens != out.tokens)
    return AcceptanceReport.pooled(
        outputs,
        num_prompts=len(prompts),
        num_draft_tokens=decoding.num_draft_tokens,
        temperature=decoding.temperature,
        top_p=decoding.top_p,
        max_new_tokens=decoding.max_new_tokens,
        plain_tokens=plain["tokens"] if compare_plain else None,
        plain_seconds=plain["seconds"] if compare_plain else None,
        plain_target_forwards=plain["forwards"] if compare_plain else None,
        greedy_mismatches=mismatches if compare_plain and greedy else None,
    )


def save_report(report: AcceptanceReport, path: str | Path) -> Path:
    path = Path(path)
    text = json.dumps(report.to_dict(), indent=2)
    with atomic_file(path) as partial:  # whole or not at all; a refusal of the OS names the file
        partial.write_text(text)
    return path
