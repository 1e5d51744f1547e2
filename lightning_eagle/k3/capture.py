"""Capture of a draft's tapped hidden states (either family) from the K3 target.

Ids are 0-based decoder-layer outputs. Under AttnRes a layer's output is its raw in-block prefix (``"prefix"``
stream, the default — what the reference hook and the public K3 drafts use); ``"mixed"`` taps what the next layer's
attention reads. Id ``num_hidden_layers`` means the input of the final norm (after the output mixer), never layer
L−1's output.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from lightning_eagle.aux_layers import AUX_STREAMS, resolve_aux_layer_ids


@dataclass
class CaptureOutput:
    aux_hidden_states: torch.Tensor  # [B,T,len(ids)·H], taps concatenated in the given order
    final_hidden: torch.Tensor  # [B,T,H], output of the final norm
    logits: torch.Tensor | None = None
    final_prenorm: torch.Tensor | None = None  # [B,T,H], input of the final norm (if asked)


def check_aux_stream(aux_stream: str) -> None:
    if aux_stream not in AUX_STREAMS:
        raise ValueError(f"aux_stream must be one of {AUX_STREAMS}, got {aux_stream!r}")


@contextmanager
def aux_taps(model, aux_layer_ids: list[int], aux_stream: str = "prefix") -> Iterator[dict]:
    """The tap rule: while active, every forward of ``model`` (a full forward or an incremental one, which runs the
    same layer and norm modules) stores tap ``i``'s tensor under key ``i`` of the yielded dict (ids validated by the
    caller; each forward of the text model starts the dict afresh). Read them with :func:`stack_taps` / :func:`tap`.

    A token-chunked forward (``token_chunk``) calls a decoder layer once but its norms once per token segment, in
    order: an input tap then holds the segments' tensors, which :func:`tap` joins along the token dimension."""
    check_aux_stream(aux_stream)
    layers = model.model.layers
    L = len(layers)
    captured: dict = {}
    handles = []

    def keep_output(idx):
        def hook(_module, _args, output):
            captured[idx] = output[0]

        return hook

    def keep_input(idx):
        def hook(_module, args):
            captured.setdefault(idx, []).append(args[0])

        return hook

    try:
        handles.append(model.model.register_forward_pre_hook(lambda _module, _args: captured.clear()))
        for i in aux_layer_ids:
            if i == L:
                handles.append(model.model.norm.register_forward_pre_hook(keep_input(i)))
            elif aux_stream == "mixed" and i + 1 < L:
                handles.append(layers[i + 1].input_layernorm.register_forward_pre_hook(keep_input(i)))
            elif aux_stream == "mixed":  # i == L-1: the output mixer's result is the final norm's input
                handles.append(model.model.norm.register_forward_pre_hook(keep_input(i)))
            else:
                handles.append(layers[i].register_forward_hook(keep_output(i)))
        yield captured
    finally:
        for h in handles:
            h.remove()


def stack_taps(captured: dict, aux_layer_ids: list[int]) -> torch.Tensor:
    """``[B,T,len(ids)·H]``: the taps concatenated in the given order."""
    return torch.cat([tap(captured, i) for i in aux_layer_ids], dim=-1)


def tap(captured: dict, idx: int) -> torch.Tensor:
    """Tap ``idx`` as one ``[B,T,H]`` tensor (an input tap's token segments joined in order)."""
    value = captured[idx]
    if isinstance(value, torch.Tensor):
        return value
    return value[0] if len(value) == 1 else torch.cat(value, dim=1)


@torch.no_grad()
def capture_hidden_states(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    aux_layer_ids: list[int] | None,
    aux_stream: str = "prefix",
    return_logits: bool = False,
    return_prenorm: bool = False,
) -> CaptureOutput:
    check_aux_stream(aux_stream)
    ids = resolve_aux_layer_ids(aux_layer_ids, len(model.model.layers))
    return capture_taps(model, input_ids, attention_mask, tuple(ids), aux_stream, return_logits, return_prenorm)


@torch.no_grad()
def capture_taps(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    taps: tuple[int, ...],
    aux_stream: str,
    return_logits: bool = False,
    return_prenorm: bool = False,
) -> CaptureOutput:
    """:func:`capture_hidden_states` with taps and stream already validated (a run's ``TargetSpec``: checked once,
    not once per batch)."""
    L, ids = len(model.model.layers), list(taps)
    with aux_taps(model, ids + [L] if return_prenorm else ids, aux_stream) as captured:
        out = model(input_ids, attention_mask, return_logits=return_logits)
    return CaptureOutput(
        stack_taps(captured, ids), out.hidden_states, out.logits, tap(captured, L) if return_prenorm else None
    )
