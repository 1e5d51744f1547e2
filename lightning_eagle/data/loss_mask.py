"""Token-level loss-mask recovery for slow Kimi tokenizers (`chat_and_loss_mask.md` §4-§6).

K2/K3 ship only a slow tokenizer, so ``apply_chat_template`` cannot return an assistant mask; we recover it from the
ids. A mask value of 1 marks a position inside an assistant content span (the trainer then supervises the prediction
of the *next* token, `eagle3_training.md` §6.3). Recoveries live in an ordered registry; the first whose
``detect`` accepts the tokenizer wins. ``kimi_k3`` is registered before ``kimi`` and ``kimi`` also defers whenever the
XTML markers resolve, because K3 tokenizers can still resolve the K2 ``<|im_*|>`` names (`chat_and_loss_mask.md`
§1.5) and the K2 recovery would return an all-zero mask on K3 data.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

XTML_MARKERS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
K2_MARKERS = ("<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<|im_end|>")


@dataclass(frozen=True)
class LossMaskRecovery:
    """A named recovery: ``detect(tokenizer) -> bool`` and ``compute(tokenizer, input_ids, **options)``.

    ``compute`` takes a 1-D LongTensor or a list and returns a LongTensor of the same length (2-D input raises;
    use :meth:`compute_batch`). ``defaults`` lists the options ``compute`` accepts, with their default values.
    """

    name: str
    detect: Callable[[Any], bool]
    compute: Callable[..., torch.Tensor]
    defaults: dict[str, Any] = field(default_factory=dict)

    def compute_batch(self, tokenizer: Any, input_ids: Any, **options: Any) -> torch.Tensor:
        """Apply :attr:`compute` to each row of a 2-D batch (padding, left or right, stays 0)."""
        batch = torch.as_tensor(input_ids)
        if batch.dim() != 2:
            raise ValueError(f"compute_batch expects 2-D ids [batch, seq], got shape {list(batch.shape)}")
        if batch.shape[0] == 0:
            return torch.zeros_like(batch, dtype=torch.long)
        return torch.stack([self.compute(tokenizer, row, **options) for row in batch])

    def resolve_options(self, **options: Any) -> dict[str, Any]:
        """Defaults overridden by ``options``; unknown names raise (they would otherwise be silently ignored)."""
        unknown = sorted(set(options) - set(self.defaults))
        if unknown:
            raise TypeError(
                f"loss-mask recovery {self.name!r} has no option(s) {unknown}; known: {sorted(self.defaults)}"
            )
        return {**self.defaults, **options}


_REGISTRY: list[LossMaskRecovery] = []


def register_loss_mask_recovery(recovery: LossMaskRecovery) -> LossMaskRecovery:
    """Append ``recovery``; registration order is detection order."""
    if any(r.name == recovery.name for r in _REGISTRY):
        raise ValueError(f"a loss-mask recovery named {recovery.name!r} is already registered")
    _REGISTRY.append(recovery)
    return recovery


def registered_loss_mask_recoveries() -> tuple[LossMaskRecovery, ...]:
    return tuple(_REGISTRY)


def get_loss_mask_recovery(tokenizer: Any) -> LossMaskRecovery | None:
    """The first registered recovery whose ``detect`` accepts ``tokenizer``, else None."""
    for recovery in _REGISTRY:
        if recovery.detect(tokenizer):
            return recovery
    return None


def get_loss_mask_recovery_by_name(name: str) -> LossMaskRecovery:
    for recovery in _REGISTRY:
        if recovery.name == name:
            return recovery
    raise KeyError(f"no loss-mask recovery named {name!r}; registered: {[r.name for r in _REGISTRY]}")


def has_all_tokens(tokenizer: Any, names: Sequence[str]) -> bool:
    """True when every name resolves to a real id (not None, not unk); any exception counts as missing."""
    try:
        unk = getattr(tokenizer, "unk_token_id", None)
        for name in names:
            token_id = tokenizer.convert_tokens_to_ids(name)
            if token_id is None or token_id == unk:
                return False
        return True
    except Exception:
        return False


def _as_id_list(input_ids: Any) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() != 1:
            raise ValueError(
                f"loss-mask compute expects 1-D ids, got shape {list(input_ids.shape)}; use compute_batch for batches"
            )
        return input_ids.tolist()
    ids = list(input_ids.tolist() if hasattr(input_ids, "tolist") else input_ids)
    if ids and isinstance(ids[0], (list, tuple)):
        raise ValueError("loss-mask compute expects 1-D ids, got a nested list; use compute_batch for batches")
    return [int(i) for i in ids]


def _pad_id(tokenizer: Any) -> int | None:
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        return None
    return None if pad == getattr(tokenizer, "unk_token_id", object()) else pad


def _spans_mask(ids: list[int], spans: list[tuple[int, int]], last_turn_only: bool, pad: int | None) -> torch.Tensor:
    """1 inside the recovered spans (only the last one with ``last_turn_only``), 0 elsewhere and on every ``pad`` id:
    padding is never content, even inside a span that runs to the end."""
    mask = [0] * len(ids)
    for start, end in spans[-1:] if last_turn_only else spans:
        mask[start:end] = [1] * (end - start)
    if pad is not None:
        mask = [0 if t == pad else m for t, m in zip(ids, mask)]
    return torch.tensor(mask, dtype=torch.long)


# ----------------------------------------------------------------------------------------------------- kimi_k3

_ATTR_RE = re.compile(r'([A-Za-z_][\w.:-]*)\s*=\s*"([^"]*)"')
_BARE_ROLE_RE = re.compile(r"(?:^|\s)role\s+([^\s=\"]+)")


def parse_header(text: str) -> tuple[str, dict[str, str]]:
    """``message role="assistant" name="x"`` -> (``message``, {role: assistant, name: x}).

    Also accepts the bare ``message role assistant`` form. Never a substring test: a header is several tokens and
    ``name="assistant"`` on a user message must not make it an assistant message.
    """
    text = text.strip()
    tag = text.split(None, 1)[0] if text else ""
    if "=" in tag:  # e.g. 'message' merged with an attribute by a tokenizer quirk; keep the word before it
        tag = tag.split("=", 1)[0]
    attrs = {k: v.replace("&quot;", '"').replace("&amp;", "&") for k, v in _ATTR_RE.findall(text)}
    if "role" not in attrs:
        bare = _BARE_ROLE_RE.search(text[len(tag) :] if text.startswith(tag) else text)
        if bare:
            attrs["role"] = bare.group(1)
    return tag, attrs


def _k3_compute(
    tokenizer: Any,
    input_ids: Any,
    *,
    include_generation_scaffold: bool = True,
    include_trailer: bool = False,
    last_turn_only: bool = False,
    drop_scaffold_only_tail: bool = True,
) -> torch.Tensor:
    ids = _as_id_list(input_ids)
    n = len(ids)
    OPEN, CLOSE, SEP, EOM = (tokenizer.convert_tokens_to_ids(t) for t in XTML_MARKERS)
    markers = {OPEN, CLOSE, SEP, EOM}
    pad = _pad_id(tokenizer)
    pad = None if pad in markers else pad
    spans: list[tuple[int, int]] = []

    i = 0
    while i < n:
        if ids[i] != OPEN:
            i += 1
            continue
        j = i + 1
        while j < n and ids[j] not in markers:
            j += 1
        if j >= n:  # truncated inside a header: nothing more is masked
            break
        if ids[j] != SEP:  # header interrupted by another marker: ignore this element, resume at that marker
            i = j
            continue
        try:
            tag, attrs = parse_header(tokenizer.decode(ids[i + 1 : j]))
        except Exception:  # undecodable header text: not an assistant message
            tag, attrs = "", {}
        # Depth walk to the matching close; <|end_of_msg|> never occurs inside a message, so it ends the walk.
        depth, k = 1, j + 1
        while k < n:
            if ids[k] == OPEN:
                depth += 1
            elif ids[k] == CLOSE:
                depth -= 1
                if depth == 0:
                    break
            elif ids[k] == EOM:
                break
            k += 1
        if tag == "message" and attrs.get("role", "").strip().casefold() == "assistant":
            start, end = j + 1, k
            if k >= n and drop_scaffold_only_tail and _scaffold_only(ids[start:], OPEN, SEP, markers, pad):
                start = end  # trailing generation prompt / cut inside the first opener: no model output yet
            if start < end and not include_generation_scaffold:
                start = _skip_leading_scaffold(ids, start, end, tokenizer, OPEN, SEP, markers)
            if include_trailer and k < n and ids[k] == CLOSE:
                end = k + 1
                while end < n and ids[end] not in markers:
                    end += 1
                if end < n and ids[end] == SEP:
                    end += 1
            if start < end:
                spans.append((start, end))
        i = k + 1 if k < n else n  # non-assistant elements are skipped whole

    return _spans_mask(ids, spans, last_turn_only, pad)


def _scaffold_only(tail: list[int], OPEN: int, SEP: int, markers: set[int], pad: int | None) -> bool:
    """True when ``tail`` holds only nested-opener scaffolding (``<|open|>``, header text, ``<|sep|>``) and padding."""
    in_header = False
    for token in tail:
        if token == pad:
            continue
        if token == OPEN:
            in_header = True
        elif token == SEP:
            in_header = False
        elif token in markers or not in_header:
            return False
    return True


def _skip_leading_scaffold(ids, start, end, tokenizer, OPEN, SEP, markers) -> int:
    """Index after a leading ``<|open|>think|response<|sep|>`` opener at ``start`` (else ``start``)."""
    if ids[start] != OPEN:
        return start
    j = start + 1
    while j < end and ids[j] not in markers:
        j += 1
    if j >= end or ids[j] != SEP:
        return start
    try:
        tag, _ = parse_header(tokenizer.decode(ids[start + 1 : j]))
    except Exception:
        return start
    return j + 1 if tag in ("think", "response") else start


def _k3_detect(tokenizer: Any) -> bool:
    return has_all_tokens(tokenizer, XTML_MARKERS)


# ----------------------------------------------------------------------------------------------------- kimi (K2)


def _k2_compute(tokenizer: Any, input_ids: Any, *, last_turn_only: bool = False) -> torch.Tensor:
    ids = _as_id_list(input_ids)
    n = len(ids)
    USER, ASSISTANT, SYSTEM, MIDDLE, END = (tokenizer.convert_tokens_to_ids(t) for t in K2_MARKERS)
    roles = {USER, ASSISTANT, SYSTEM}
    spans: list[tuple[int, int]] = []
    i = 0
    while i < n:
        if ids[i] != ASSISTANT:
            i += 1
            continue
        j = i + 1
        while j < n and ids[j] != MIDDLE and ids[j] not in roles and ids[j] != END:
            j += 1
        if j >= n or ids[j] != MIDDLE:  # malformed turn or bare generation prompt: resume AT the stopping token
            i = j
            continue
        k = j + 1
        while k < n and ids[k] != END and ids[k] not in roles:
            k += 1
        if j + 1 < k:
            spans.append((j + 1, k))
        i = k
    return _spans_mask(ids, spans, last_turn_only, _pad_id(tokenizer))


def _k2_detect(tokenizer: Any) -> bool:
    return has_all_tokens(tokenizer, K2_MARKERS) and not has_all_tokens(tokenizer, XTML_MARKERS)


KIMI_K3_DEFAULTS = {
    "include_generation_scaffold": True,
    "include_trailer": False,
    "last_turn_only": False,
    "drop_scaffold_only_tail": True,
}

KIMI_K3 = register_loss_mask_recovery(LossMaskRecovery("kimi_k3", _k3_detect, _k3_compute, dict(KIMI_K3_DEFAULTS)))
KIMI_K2 = register_loss_mask_recovery(LossMaskRecovery("kimi", _k2_detect, _k2_compute, {"last_turn_only": False}))
