"""Held-out prompts for measuring real acceptance: conversations up to an assistant turn, rendered with the K3
generation prompt (what a K3 server sees), from chat files, chats, pre-tokenized rows or a ``ChatDataModule``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch


def load_chat_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL/JSON chat file (the training data formats)."""
    from lightning_eagle.data.formats import iter_rows
    from lightning_eagle.data.rows import DataRowError

    rows = []
    for row in iter_rows(path):
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


def prompts_from_token_rows(
    rows: Iterable[tuple[Sequence[int], Sequence[int]]],
    max_prompts: int | None = None,
    max_prompt_tokens: int | None = None,
):
    """Pre-tokenized rows ``(input_ids, loss_mask)``: a prompt ends where each supervised span starts (the
    assistant body after its header). Prompts longer than ``max_prompt_tokens`` are skipped."""
    prompts: list[list[int]] = []
    for ids, mask in rows:
        ids, mask = list(map(int, ids)), list(map(int, mask))
        for t in range(1, len(ids)):
            if max_prompt_tokens is not None and t > max_prompt_tokens:
                break  # every later span's prompt is longer still
            if mask[t] and not mask[t - 1]:
                prompts.append(ids[:t])
                if max_prompts is not None and len(prompts) >= max_prompts:
                    return prompts
    return prompts


def prompts_from_datamodule(
    datamodule, max_prompts: int | None = None, max_prompt_tokens: int | None = None
) -> list[list[int]]:
    """Prompts from a :class:`~lightning_eagle.data.ChatDataModule`'s validation rows (held out from training),
    rendered from the source chats with the data module's tokenizer and render options; pre-tokenized rows use their
    loss-mask spans. Rendered prompts longer than ``max_prompt_tokens`` (None: the data module's ``max_length``) are
    skipped: with long-context data, a smaller cap keeps speculative decoding's prefill short."""
    if max_prompt_tokens is None:
        max_prompt_tokens = datamodule.max_length
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
                from lightning_eagle.data.formats import iter_rows
                from lightning_eagle.data.rows import RawRow

                sources[file] = {r.line: r.data for r in iter_rows(file) if isinstance(r, RawRow)}
            data = sources[file].get(line)
        if isinstance(data, dict) and "messages" in data:
            prompts += prompts_from_chats(
                [data], datamodule.tokenizer, left, max_prompt_tokens, **datamodule.render_options
            )
        else:
            item = base[idx]
            prompts += prompts_from_token_rows([(item["input_ids"], item["loss_mask"])], left, max_prompt_tokens)
    return prompts


def bundled_held_out_prompts(
    max_prompts: int | None = None, max_prompt_tokens: int | None = None, **datamodule_kwargs: Any
) -> list[list[int]]:
    """Held-out prompts of the bundled synthetic corpus: the validation split of a default ``ChatDataModule`` with
    the quickstart's data settings (synthetic tokenizer, thinking on, no effort note, 5 % held out, seed 0).
    ``max_prompt_tokens``: as :func:`prompts_from_datamodule`'s (None: its ``max_length``)."""
    from lightning_eagle.data.datamodule import ChatDataModule

    kwargs = {"max_length": 256, "thinking": True, "thinking_effort": None, "val_fraction": 0.05}
    kwargs.update(datamodule_kwargs)
    return prompts_from_datamodule(ChatDataModule(**kwargs), max_prompts, max_prompt_tokens)


def resolve_prompts(
    data,
    tokenizer,
    num_prompts: int | None,
    render_options: dict[str, Any],
    max_prompt_tokens: int | None = None,
) -> list[list[int]]:
    """The first ``num_prompts`` (None: all) prompts of ``data`` of at most ``max_prompt_tokens`` tokens (None: no
    cap, but a ``ChatDataModule`` — the bundled one for None — applies its own ``max_length``); longer ones are
    skipped while reading, so a cap never shortens the list while the source has prompts that fit.

    ``data``: None (bundled held-out chats), a chat file path, a ChatDataModule, chats, or token-id prompts."""
    cap = max_prompt_tokens
    if data is None:
        return bundled_held_out_prompts(num_prompts, cap)
    if isinstance(data, (str, Path)):
        rows = load_chat_rows(data)
        chats = [r for r in rows if "messages" in r]
        if chats:
            return prompts_from_chats(chats, _tokenizer(tokenizer), num_prompts, cap, **render_options)
        # Pre-tokenized rows: only their loss masks say where assistant turns start.
        token_rows = [(r["input_ids"], r["loss_mask"]) for r in rows if "input_ids" in r and r.get("loss_mask")]
        return prompts_from_token_rows(token_rows, num_prompts, cap)
    if hasattr(data, "val_dataset") and hasattr(data, "tokenizer"):
        return prompts_from_datamodule(data, num_prompts, cap)
    items = list(data)
    if items and all(_is_token_ids(x) for x in items):
        prompts = [torch.as_tensor(p).tolist() for p in items]
        return [p for p in prompts if cap is None or len(p) <= cap][:num_prompts]
    return prompts_from_chats(items, _tokenizer(tokenizer), num_prompts, cap, **render_options)


def _is_token_ids(item) -> bool:
    if isinstance(item, torch.Tensor):
        return True
    return isinstance(item, (list, tuple)) and all(isinstance(t, int) for t in item)


def _tokenizer(tokenizer):
    if tokenizer is None or isinstance(tokenizer, str):
        from lightning_eagle.data.tokenizer_choice import resolve_tokenizer

        return resolve_tokenizer(tokenizer or "synthetic")
    return tokenizer
