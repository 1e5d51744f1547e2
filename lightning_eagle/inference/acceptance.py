"""Real acceptance length: run speculative decoding on held-out chat prompts and report τ, per-position acceptance
and throughput against plain decoding measured in the same run.

Prompts are conversations up to an assistant turn, rendered with the generation prompt (what a K3 server sees). The
report pools all verification rounds of all prompts:

* ``tau`` = mean(accepted + 1) over rounds = tokens per verification forward (comparable to training's τ_sim);
* ``acceptance_at_least[j−1]`` = share of rounds accepting ≥ j drafts (so ``tau = 1 + Σ_j acceptance_at_least``
  when every round drafts K) and ``acceptance_per_position[j−1]`` = P(draft j accepted | drafts 1..j−1 accepted);
* throughput: generated tokens per second of speculative decoding (wall, draft included), per second of its target
  forwards only, and of plain target-only decoding over the same prompts; ``speedup`` is their ratio on this
  machine. At temperature 0 the two outputs must agree token for token (``greedy_mismatches`` counts prompts that
  did not — 0 unless something is broken or two logits tie to fp32 rounding).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_eagle.inference.plain import plain_generate
from lightning_eagle.inference.speculative import speculative_generate


@dataclass
class AcceptanceReport:
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

    @property
    def num_rounds(self) -> int:
        return len(self.accepted_per_round)

    @property
    def tau(self) -> float:
        if not self.accepted_per_round:
            return float("nan")
        return 1.0 + sum(self.accepted_per_round) / self.num_rounds

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
            "acceptance_at_least",
            "acceptance_per_position",
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
            f"temperature {self.temperature}, max_new_tokens {self.max_new_tokens}",
            f"tau_real (tokens per target forward)   {fmt(self.tau)}",
            "P(accept draft j | 1..j-1 accepted)    " + " ".join(fmt(r) for r in self.acceptance_per_position),
            "P(accepted >= j)                       " + " ".join(fmt(r) for r in self.acceptance_at_least),
            f"speculative tokens/s (wall)            {fmt(self.spec_tokens_per_s)}",
            f"speculative tokens/s (target time)     {fmt(self.spec_tokens_per_target_s)}",
            f"plain decoding tokens/s                {fmt(self.plain_tokens_per_s)}",
            f"speed-up (wall) / (target only)        {fmt(self.speedup)} / {fmt(self.target_speedup)}",
        ]
        if self.greedy_mismatches is not None:
            lines.append(f"greedy mismatches vs plain decoding    {self.greedy_mismatches}")
        return "\n".join(lines)


# ---- prompts --------------------------------------------------------------------------------------------------------
def load_chat_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL/JSON chat file (the training data formats)."""
    from lightning_eagle.data.rows import DataRowError, iter_raw_rows

    rows = []
    for row in iter_raw_rows(path):
        if isinstance(row, DataRowError):
            raise row
        rows.append(row.data)
    return rows


def prompts_from_chats(
    chats: Iterable[Any],
    tokenizer,
    max_prompts: int | None = None,
    max_prompt_tokens: int | None = None,
    **render_options: Any,
) -> list[list[int]]:
    """One prompt per assistant turn: the messages before it, rendered with the K3 generation prompt.

    ``chats``: rows with ``messages`` (and optional ``tools``) or plain message lists. ``render_options``:
    ``thinking`` / ``thinking_effort`` as in training (keep them equal to the data module's)."""
    from lightning_eagle.data.render_k3 import render_k3_chat

    prompts: list[list[int]] = []
    for chat in chats:
        messages, tools = (chat.get("messages"), chat.get("tools")) if isinstance(chat, dict) else (chat, None)
        if messages is None:
            continue
        for i, message in enumerate(messages):
            if i == 0 or message.get("role") != "assistant":
                continue
            ids = render_k3_chat(messages[:i], tokenizer, tools=tools, add_generation_prompt=True, **render_options)
            if max_prompt_tokens is None or len(ids) <= max_prompt_tokens:
                prompts.append(ids)
            if max_prompts is not None and len(prompts) >= max_prompts:
                return prompts
    return prompts


def prompts_from_token_rows(rows: Iterable[tuple[Sequence[int], Sequence[int]]], max_prompts: int | None = None):
    """Pre-tokenized rows ``(input_ids, loss_mask)``: a prompt ends where each supervised span starts (the
    assistant body after its header)."""
    prompts: list[list[int]] = []
    for ids, mask in rows:
        ids, mask = list(map(int, ids)), list(map(int, mask))
        for t in range(1, len(ids)):
            if mask[t] and not mask[t - 1]:
                prompts.append(ids[:t])
                if max_prompts is not None and len(prompts) >= max_prompts:
                    return prompts
    return prompts


def prompts_from_datamodule(datamodule, max_prompts: int | None = None) -> list[list[int]]:
    """Prompts from a :class:`~lightning_eagle.data.ChatDataModule`'s validation rows (held out from training),
    rendered from the source chats with the data module's tokenizer and render options; pre-tokenized rows use their
    loss-mask spans."""
    if getattr(datamodule, "val_dataset", None) is None:
        datamodule.setup("validate")
    val = datamodule.val_dataset
    if val is None or len(val) == 0:
        return []
    base, indices = (val.dataset, val.indices) if hasattr(val, "indices") else (val, range(len(val)))
    sources: dict[str, dict[int, Any]] = {}
    prompts: list[list[int]] = []
    for idx in indices:
        left = None if max_prompts is None else max_prompts - len(prompts)
        if left is not None and left <= 0:
            break
        data = None
        if hasattr(base, "source"):
            file, line = base.source(idx)
            if file not in sources:
                from lightning_eagle.data.rows import RawRow, iter_raw_rows

                sources[file] = {r.line: r.data for r in iter_raw_rows(file) if isinstance(r, RawRow)}
            data = sources[file].get(line)
        if isinstance(data, dict) and "messages" in data:
            prompts += prompts_from_chats(
                [data], datamodule.tokenizer, left, datamodule.max_length, **datamodule.render_options
            )
        else:
            item = base[idx]
            prompts += prompts_from_token_rows([(item["input_ids"], item["loss_mask"])], left)
    return prompts


def bundled_held_out_prompts(max_prompts: int | None = None, **datamodule_kwargs: Any) -> list[list[int]]:
    """Held-out prompts of the bundled synthetic corpus: the validation split of a default ``ChatDataModule`` with
    the quickstart's data settings (synthetic tokenizer, thinking on, no effort note, 5 % held out, seed 0)."""
    from lightning_eagle.data.datamodule import ChatDataModule

    kwargs = {"max_length": 256, "thinking": True, "thinking_effort": None, "val_fraction": 0.05}
    kwargs.update(datamodule_kwargs)
    return prompts_from_datamodule(ChatDataModule(**kwargs), max_prompts)


def resolve_prompts(data, tokenizer, num_prompts: int, render_options: dict[str, Any]) -> list[list[int]]:
    """``data``: None (bundled held-out chats), a chat file path, a ChatDataModule, chats, or token-id prompts."""
    if data is None:
        return bundled_held_out_prompts(num_prompts)
    if isinstance(data, (str, Path)):
        rows = load_chat_rows(data)
        chats = [r for r in rows if "messages" in r]
        if chats:
            return prompts_from_chats(chats, _tokenizer(tokenizer), num_prompts, **render_options)
        # Pre-tokenized rows: only their loss masks say where assistant turns start.
        token_rows = [(r["input_ids"], r["loss_mask"]) for r in rows if "input_ids" in r and r.get("loss_mask")]
        return prompts_from_token_rows(token_rows, num_prompts)
    if hasattr(data, "val_dataset") and hasattr(data, "tokenizer"):
        return prompts_from_datamodule(data, num_prompts)
    items = list(data)
    if items and all(_is_token_ids(x) for x in items):
        return [torch.as_tensor(p).tolist() for p in items[:num_prompts]]
    return prompts_from_chats(items, _tokenizer(tokenizer), num_prompts, **render_options)


def _is_token_ids(item) -> bool:
    if isinstance(item, torch.Tensor):
        return True
    return isinstance(item, (list, tuple)) and all(isinstance(t, int) for t in item)


def _tokenizer(tokenizer):
    if tokenizer is None or isinstance(tokenizer, str):
        from lightning_eagle.data.tokenizer import resolve_tokenizer

        return resolve_tokenizer(tokenizer or "synthetic")
    return tokenizer


# ---- evaluation -----------------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate_acceptance(
    target,
    draft,
    data=None,
    *,
    tokenizer=None,
    num_prompts: int = 16,
    max_new_tokens: int = 64,
    num_draft_tokens: int | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    aux_layer_ids: list[int] | None = None,
    stop_token_ids: Iterable[int] | str | None = "eos",
    compare_plain: bool = True,
    warmup: bool = True,
    thinking: bool = True,
    thinking_effort: str | None = None,
) -> AcceptanceReport:
    """Speculative decoding over held-out prompts → :class:`AcceptanceReport` (see the module docstring).

    Args:
        data: None = held-out chats of the bundled corpus; a JSONL/JSON chat file; a ``ChatDataModule`` (its
            validation split); a list of chats; or a list of token-id prompts.
        tokenizer: for chats (default: the synthetic K3 tokenizer; a path or ``KimiTokenizer`` for real data).
        num_draft_tokens: K (default: the draft's ``ttt_steps``).
        stop_token_ids: ``"eos"`` = the target's ``eos_token_id`` (K3's ``<|end_of_msg|>``), None = never stop.
        compare_plain: also decode every prompt with the target alone (throughput baseline; at temperature 0 also a
            losslessness check).
        warmup: one short untimed run first (allocator / first-call costs are not decoding speed).
        thinking / thinking_effort: render options for chats (as in training).
    """
    K = num_draft_tokens if num_draft_tokens is not None else int(getattr(draft.config, "ttt_steps", 7))
    render_options = {"thinking": thinking, "thinking_effort": thinking_effort}
    prompts = resolve_prompts(data, tokenizer, num_prompts, render_options)[:num_prompts]
    if not prompts:
        raise ValueError("no prompts: the data holds no conversation with an assistant turn")
    vocab = target.config.vocab_size
    too_big = [max(p) for p in prompts if max(p) >= vocab]
    if too_big:
        raise ValueError(f"prompt token id {max(too_big)} >= target vocab_size {vocab}: tokenizer and target differ")
    if stop_token_ids == "eos":
        eos = getattr(target.config, "eos_token_id", None)
        stop_token_ids = [] if eos is None else [eos]
    was_training = draft.training if hasattr(draft, "training") else False
    if hasattr(draft, "eval"):
        draft.eval()
    common = {"stop_token_ids": stop_token_ids}
    try:
        if warmup:
            speculative_generate(target, draft, prompts[0], 4, K, temperature, seed, aux_layer_ids, **common)
            if compare_plain:
                plain_generate(target, prompts[0], 4, temperature, seed, **common)
        accepted: list[int] = []
        spec = {"tokens": 0, "seconds": 0.0, "target": 0.0, "draft": 0.0, "forwards": 0}
        plain = {"tokens": 0, "seconds": 0.0, "forwards": 0}
        mismatches = 0
        for i, prompt in enumerate(prompts):
            out = speculative_generate(
                target, draft, prompt, max_new_tokens, K, temperature, seed + i, aux_layer_ids, **common
            )
            accepted += out.accepted_per_round
            spec["tokens"] += len(out.tokens)
            spec["seconds"] += out.seconds
            spec["target"] += out.target_seconds
            spec["draft"] += out.draft_seconds
            spec["forwards"] += out.target_forwards
            if compare_plain:
                ref = plain_generate(target, prompt, max_new_tokens, temperature, seed + i, **common)
                plain["tokens"] += len(ref.tokens)
                plain["seconds"] += ref.seconds
                plain["forwards"] += ref.target_forwards
                mismatches += int(temperature == 0 and ref.tokens != out.tokens)
    finally:
        if was_training:
            draft.train()
    return AcceptanceReport(
        num_prompts=len(prompts),
        num_draft_tokens=K,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        accepted_per_round=accepted,
        spec_tokens=spec["tokens"],
        spec_seconds=spec["seconds"],
        spec_target_seconds=spec["target"],
        spec_draft_seconds=spec["draft"],
        spec_target_forwards=spec["forwards"],
        plain_tokens=plain["tokens"] if compare_plain else None,
        plain_seconds=plain["seconds"] if compare_plain else None,
        plain_target_forwards=plain["forwards"] if compare_plain else None,
        greedy_mismatches=mismatches if compare_plain and temperature == 0 else None,
    )


def save_report(report: AcceptanceReport, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(report.to_dict(), indent=2))
    return path
