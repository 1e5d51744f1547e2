"""EAGLE-3 hidden-state capture from the K3 target.

Ids are 0-based decoder-layer outputs. Under AttnRes a layer's output is its raw in-block prefix (``"prefix"``
stream, the default — what the reference hook and the public K3 drafts use); ``"mixed"`` taps what the next layer's
attention reads. Id ``num_hidden_layers`` means the input of the final norm (after the output mixer), never layer
L−1's output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_eagle.aux_layers import validate_aux_layer_ids

AUX_STREAMS = ("prefix", "mixed")


@dataclass
class CaptureOutput:
    aux_hidden_states: torch.Tensor  # [B,T,len(ids)·H], taps concatenated in the given order
    final_hidden: torch.Tensor  # [B,T,H], output of the final norm
    logits: torch.Tensor | None = None
    final_prenorm: torch.Tensor | None = None  # [B,T,H], input of the final norm (if asked)


def resolve_aux_layer_ids(aux_layer_ids, num_hidden_layers: int) -> list[int]:
    """Explicit ids are validated; None means the default ``[1, L//2 − 1, L − 4]``, which collides or goes out of
    range on very shallow targets — then the user must pass ids."""
    if aux_layer_ids is not None:
        return validate_aux_layer_ids(aux_layer_ids, num_hidden_layers)
    L = num_hidden_layers
    default = [1, L // 2 - 1, L - 4]
    try:
        return validate_aux_layer_ids(default, L)
    except ValueError as err:
        raise ValueError(
            f"the default EAGLE-3 aux_layer_ids [1, L//2-1, L-4] = {default} are invalid for a {L}-layer target "
            f"({err}); pass aux_layer_ids explicitly (e.g. [1, {max(L // 2, 2)}, {L - 1}] for k3-tiny: [1, 3, 5])"
        ) from None


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
    if aux_stream not in AUX_STREAMS:
        raise ValueError(f"aux_stream must be one of {AUX_STREAMS}, got {aux_stream!r}")
    layers = model.model.layers
    L = len(layers)
    ids = resolve_aux_layer_ids(aux_layer_ids, L)
    captured: dict[int, torch.Tensor] = {}
    handles = []

    def keep_output(idx):
        def hook(_module, _args, output):
            captured[idx] = output[0]

        return hook

    def keep_input(idx):
        def hook(_module, args):
            captured[idx] = args[0]

        return hook

    try:
        for i in ids:
            if i == L:
                handles.append(model.model.norm.register_forward_pre_hook(keep_input(i)))
            elif aux_stream == "mixed" and i + 1 < L:
                handles.append(layers[i + 1].input_layernorm.register_forward_pre_hook(keep_input(i)))
            elif aux_stream == "mixed":  # i == L-1: the output mixer's result is the final norm's input
                handles.append(model.model.norm.register_forward_pre_hook(keep_input(i)))
            else:
                handles.append(layers[i].register_forward_hook(keep_output(i)))
        if return_prenorm:
            handles.append(model.model.norm.register_forward_pre_hook(keep_input("prenorm")))
        out = model(input_ids, attention_mask, return_logits=return_logits)
    finally:
        for h in handles:
            h.remove()
    aux = torch.cat([captured[i] for i in ids], dim=-1)
    return CaptureOutput(aux, out.hidden_states, out.logits, captured.get("prenorm"))
