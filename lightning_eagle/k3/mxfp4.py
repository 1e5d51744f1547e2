"""MXFP4 (OCP microscaling FP4, compressed-tensors ``mxfp4-pack-quantized``) decode for K3's routed experts.

``weight_packed`` uint8 ``[out, in/2]``: byte j holds element 2j in the low nibble and 2j+1 in the high nibble; a
nibble is an FP4 E2M1 code (bit 3 = sign). ``weight_scale`` uint8 ``[out, in/32]``: an E8M0 exponent per 32 inputs,
value ``2^(s − 127)``. Scales stay uint8 so an accidental float cast can never corrupt them.
"""

from __future__ import annotations

import torch

GROUP_SIZE = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def decode_mxfp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
    name: str = "weight",
    check_scales: bool = True,
) -> torch.Tensor:
    """Decode ``packed [..., out, in/2]`` with ``scale [..., out, in/32]`` to ``[..., out, in]`` (fp32 math, then
    ``dtype``); writes into ``out`` (any strides) when given. Leading dimensions are batch dimensions, so one call
    decodes a whole stack of experts.

    ``check_scales=False`` skips the refusal of scale byte 255 (NaN in E8M0): that check reads a flag back to the
    host, so the expert forward (whose buffers the loader already checked) turns it off to stay free of host syncs.
    """
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 weight_packed/weight_scale must be uint8, got {packed.dtype}/{scale.dtype}")
    *lead, rows, half = packed.shape
    cols = 2 * half
    if cols % GROUP_SIZE:
        raise ValueError(f"{name}: MXFP4 input width {cols} is not divisible by the group size {GROUP_SIZE}")
    if tuple(scale.shape) != (*lead, rows, cols // GROUP_SIZE):
        raise ValueError(
            f"{name}: weight_scale shape {tuple(scale.shape)} does not match weight_packed {tuple(packed.shape)} "
            f"(expected {(*lead, rows, cols // GROUP_SIZE)})"
        )
    if check_scales and bool((scale == 255).any()):
        raise ValueError(f"{name}: MXFP4 scale byte 255 (NaN in E8M0) found")
    # One lookup per byte: entry b holds (value of its low nibble, value of its high nibble), i.e. the two
    # interleaved columns. int32 indices (not int64) keep the transient at ~6 bytes per weight beside the result,
    # which matters when a whole layer's experts are decoded at once.
    nibble = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    byte_table = torch.stack([nibble.repeat(16), nibble.repeat_interleave(16)], dim=-1)  # [256, 2]
    values = byte_table[packed.int()].view(*lead, rows, cols // GROUP_SIZE, GROUP_SIZE)
    values.mul_(torch.exp2(scale.float() - 127.0)[..., None])
    values = values.view(*lead, rows, cols)
    if out is None:
        return values.to(dtype)
    if tuple(out.shape) != (*lead, rows, cols):
        raise ValueError(f"{name}: destination shape {tuple(out.shape)} != decoded shape {(*lead, rows, cols)}")
    out.copy_(values)
    return out


def encode_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest MXFP4 encode (for synthetic checkpoints and tests); ``decode(encode(w))`` is the projection
    of ``w`` onto the MXFP4 grid, exact for weights already on it."""
    rows, cols = weight.shape
    if cols % GROUP_SIZE:
        raise ValueError(f"MXFP4 input width {cols} is not divisible by {GROUP_SIZE}")
    w = weight.float().view(rows, cols // GROUP_SIZE, GROUP_SIZE)
    amax = w.abs().amax(-1).clamp_min(2.0**-126)
    # Pick the exponent so the largest magnitude fits under 6 (the largest E2M1 value).
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = w / torch.exp2(exp)[..., None]
    table = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32)
    mag = (scaled.abs()[..., None] - table).abs().argmin(-1)
    codes = (mag | ((scaled < 0).long() << 3)).view(rows, cols)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed, (exp + 127).to(torch.uint8)
