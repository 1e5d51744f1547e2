"""TTT attention at step k (`eagle3_training.md` §4.2, §8): queries of step k attend to the step-0 keys through the
causal ∧ key-not-pad block, plus one diagonal column per cached later step (slot t sees its own keys of steps 1..k).

Backends (the setting ``model.draft.attention_backend``, registry
:data:`~lightning_eagle.backends.TTT_ATTENTION_BACKEND`; all take ``(q [B,n,T,d_qk], cache, scale)`` and return
``o [B,n,T,d_v]``):

* ``"eager"`` — the readable twin and the reference's exact formulation: materialises the ``[B,n,T,T+k]`` scores and
  fp32 probabilities. Default; used by the golden test.
* ``"flash_lse"`` — no ``[B,n,T,T+k]`` tensor: the causal block runs through an LSE-returning kernel
  (:mod:`lightning_eagle.draft.block_attention`), the k diagonal columns are computed per chunk of slots (``chunk``
  slots of every later step at once, :data:`DEFAULT_DIAGONAL_CHUNK`; no ``[k,B,n,T,d]`` stack, forward or backward),
  and the two are merged through the log-sum-exp inside a custom ``autograd.Function`` whose backward feeds the
  merged output and LSE to the block kernel's backward (the gradient trap of §8). Step 0 is the same function with
  no diagonal columns, i.e. plain causal attention. The long-context backend: for an unpadded or right-padded batch
  (what training feeds) the block rule is a tensor-free :class:`~lightning_eagle.draft.block_attention.CausalBlock`,
  so no step builds or keeps any ``[T,T]`` tensor; any other mask (left padding, holes) takes the exact additive
  ``[B|1,1,T,T]`` mask (:func:`step_zero_rule`). Either way every row, padding rows included, equals ``eager``.
* ``"sdpa_mask"`` — one ``F.scaled_dot_product_attention`` call over the concatenated keys ``[K_0 ; K_1 ; … ; K_k]``
  (length ``T·(k+1)``) with a boolean ``[B|1,1,T,T·(k+1)]`` mask: fused on CUDA (memory-efficient kernel), torch's
  math path on CPU (there it materialises ``[B,n,T,T·(k+1)]`` scores; it is the CPU *training* check of the layout).
  Not a long-context backend: its mask is O(T²) per step (``eager``'s scores and additive mask too).
* ``"flex_attention"`` — the same concatenated keys through compiled ``flex_attention`` with a block mask: fully masked
  128×128 tiles are skipped, so step k costs about one causal block plus k diagonal tiles per query tile. CUDA is its
  home; torch 2.13 has no flex backward on CPU, so on CPU it runs forward-only (unfused) and refuses gradients.
* ``"auto"`` — resolves per call from ``q.device`` through the registry's rule.

Per-device rule (:func:`~lightning_eagle.backends.default_ttt_attention`): CUDA → ``flex_attention`` when Triton
can compile it, else ``sdpa_mask``; any other device → ``flash_lse`` (the fused CPU flash kernel on CPU).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from lightning_eagle import backends
from lightning_eagle.backends import AUTO
from lightning_eagle.draft.block_attention import BlockRule, accumulate_dtype, default_kernel
from lightning_eagle.draft.cache import TTTCache

TTTAttention = Callable[[torch.Tensor, TTTCache, float], torch.Tensor]
_KERNELS: dict[str, TTTAttention] = {}


def register_ttt_attention(name: str, fn: TTTAttention, why: str = "registered by the user") -> None:
    """Add (or replace) the backend ``name``; ``attention_backend: name`` then selects ``fn``."""
    registry = backends.TTT_ATTENTION_BACKEND
    if name != AUTO and name not in registry.names:  # the settings then accept the name too
        backends.TTT_ATTENTION_BACKEND = registry.with_backend(name, why)
    _KERNELS[name] = fn


def get_ttt_attention(name: str) -> TTTAttention:
    """The attention function of backend ``name`` (``"auto"``: one that resolves per call from ``q.device``)."""
    return _KERNELS[backends.TTT_ATTENTION_BACKEND.check(name)]


def ttt_attention_backends() -> list[str]:
    return sorted(backends.TTT_ATTENTION_BACKEND.choices)


# ---- eager (the naive twin) ------------------------------------------------------------------------------------------
def eager_ttt_attention(q: torch.Tensor, cache: TTTCache, scale: float) -> torch.Tensor:
    """Scores ``[B,n,T,T+k]`` = (block over K_0 + mask) ‖ (one diagonal score per cached step 1..k); fp32 softmax.
    The readable twin, O(T²) by construction (scores and the additive ``[B|1,1,T,T]`` mask): not for long context."""
    T = q.shape[-2]
    k0, v0 = cache.keys[0], cache.values[0]
    scores = torch.matmul(q, k0.transpose(-1, -2)) * scale
    scores = scores + cache.additive_mask(T, scores.dtype, scores.device)
    steps = len(cache) - 1
    if steps:
        later_k = torch.stack(cache.keys[1:], dim=0)  # [k,B,n,T,d_qk]
        diag = torch.einsum("bntc,sbntc->bnts", q, later_k) * scale  # Q_k[t]·K_i[t]
        scores = torch.cat([scores, diag], dim=-1)
    probs = torch.softmax(scores.to(accumulate_dtype(scores.dtype)), dim=-1).to(q.dtype)  # fp32 (fp64 stays fp64)
    out = torch.matmul(probs[..., :T], v0)
    if steps:
        later_v = torch.stack(cache.values[1:], dim=0)  # [k,B,n,T,d_v]
        out = out + torch.einsum("bnts,sbntd->bntd", probs[..., T:], later_v)
    return out


# ---- flash_lse (block kernel + diagonal columns merged through the LSE) ---------------------------------------------
DEFAULT_DIAGONAL_CHUNK = 512  # slots whose later-step K/V columns are processed at once (flash_lse)


def _later_slots(tensors, start: int, end: int, acc: torch.dtype) -> torch.Tensor:
    """Slots ``start:end`` of the later steps' K (or V), slot-major ``[B,n,chunk,k,d]`` in the accumulate dtype: every
    product below is then one batched matmul over ``B·n·chunk`` without a relayout copy."""
    return torch.stack([t[..., start:end, :] for t in tensors], dim=-2).to(acc)


def _diagonal_scores(q_c: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """``[B,n,chunk,k]``: ``Q[t]·K_i[t]`` of each slot and later step."""
    return torch.matmul(keys, q_c[..., None]).squeeze(-1) * scale


def _mix(weights: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``Σ_i weights[..., i]·rows[..., i, :]`` per slot: ``[B,n,chunk,k]`` × ``[B,n,chunk,k,d]`` → ``[B,n,chunk,d]``."""
    return torch.matmul(weights[..., None, :], rows).squeeze(-2)


class _LSEMergedTTTAttention(torch.autograd.Function):
    """``O = exp(lse_b − lse)·O_b + Σ_i exp(d_i − lse)·V_i[t]`` with ``lse = logaddexp(lse_b, logsumexp_i d_i)``.

    The diagonal columns are computed slot chunk by slot chunk (``chunk`` slots of every later step at once), in the
    forward and again in the backward: besides the kernel's own tiles and the outputs, nothing larger than
    ``k·[B,n,chunk,d_qk+d_v]`` (fp32) exists, whatever T. Later-step K/V are passed individually (not stacked) so that
    nothing O(k²) is saved across the unroll, and their gradients are written into one output per step.
    """

    @staticmethod
    def forward(ctx, q, k0, v0, mask, scale, kernel, chunk, num_diag, *later):
        later_k, later_v = later[:num_diag], later[num_diag:]
        acc = accumulate_dtype(q.dtype)
        out_b, lse_b = kernel.forward(q, k0, v0, mask, scale)
        if num_diag:
            out = torch.empty(out_b.shape, dtype=q.dtype, device=q.device)
            lse = torch.empty(lse_b.shape, dtype=lse_b.dtype, device=q.device)
            for start in range(0, q.shape[-2], chunk):
                end = min(q.shape[-2], start + chunk)
                diag = _diagonal_scores(q[..., start:end, :].to(acc), _later_slots(later_k, start, end, acc), scale)
                block_lse = lse_b[..., start:end].to(acc)
                lse_c = torch.logaddexp(block_lse, torch.logsumexp(diag, dim=-1))
                o = torch.exp(block_lse - lse_c)[..., None] * out_b[..., start:end, :].to(acc)
                o = o + _mix(torch.exp(diag - lse_c[..., None]), _later_slots(later_v, start, end, acc))
                out[..., start:end, :], lse[..., start:end] = o, lse_c
        else:
            out, lse = out_b, lse_b
        # A CausalBlock rule is no tensor (its [B] lengths need no saving hook); an additive mask is saved as one.
        tensor_mask = mask if isinstance(mask, torch.Tensor) else None
        ctx.save_for_backward(q, k0, v0, tensor_mask, out, lse, *later)
        ctx.scale, ctx.kernel, ctx.chunk, ctx.num_diag = scale, kernel, chunk, num_diag
        ctx.rule = None if tensor_mask is not None else mask
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k0, v0, mask, out, lse, *later = ctx.saved_tensors
        scale, chunk, num_diag = ctx.scale, ctx.chunk, ctx.num_diag
        mask = mask if ctx.rule is None else ctx.rule
        # Block columns: the kernel recomputes P = exp(S − lse) with the *merged* lse and uses D = rowsum(dO ⊙ O) with
        # the *merged* O, i.e. the block part of the full-row softmax gradient.
        dq, dk0, dv0 = ctx.kernel.backward(grad_out, q, k0, v0, mask, out, lse, scale)
        if not num_diag:
            return (dq, dk0, dv0, None, None, None, None, None)
        acc = accumulate_dtype(q.dtype)
        later_k, later_v = later[:num_diag], later[num_diag:]
        # One gradient per later step, filled slot chunk by slot chunk (no [k,B,n,T,d] stack, no fp32 copy).
        d_later = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in later]
        for start in range(0, q.shape[-2], chunk):
            end = min(q.shape[-2], start + chunk)
            keys, values = _later_slots(later_k, start, end, acc), _later_slots(later_v, start, end, acc)
            q_c, do = q[..., start:end, :].to(acc), grad_out[..., start:end, :].to(acc)
            probs = torch.exp(_diagonal_scores(q_c, keys, scale) - lse[..., start:end, None].to(acc))  # [B,n,C,k]
            delta = (do * out[..., start:end, :].to(acc)).sum(-1, keepdim=True)
            ds = probs * (torch.matmul(values, do[..., None]).squeeze(-1) - delta)
            # The kernel's dq is ours: its rows gain the diagonal part in place (rounded once, as one sum).
            dq[..., start:end, :] = dq[..., start:end, :].to(acc) + _mix(ds, keys) * scale
            del keys, values
            d_keys = (ds * scale)[..., None] * q_c[..., None, :]  # [B,n,C,k,d_qk]
            for i in range(num_diag):
                d_later[i][..., start:end, :] = d_keys[..., i, :]
            del d_keys
            d_values = probs[..., None] * do[..., None, :]  # [B,n,C,k,d_v]
            for i in range(num_diag):
                d_later[num_diag + i][..., start:end, :] = d_values[..., i, :]
            del d_values  # before the next chunk's K/V: one chunk's temporaries at a time
        return (dq, dk0, dv0, None, None, None, None, None, *d_later)


def step_zero_rule(cache: TTTCache, q: torch.Tensor) -> BlockRule:
    """The block rule ``flash_lse`` hands its kernel: the tensor-free
    :class:`~lightning_eagle.draft.block_attention.CausalBlock` for an unpadded or right-padded batch (the training
    batches: no ``[T,T]`` tensor at all), else — left padding, holes — the exact additive ``[B|1,1,T,T]`` mask of the
    eager twin (O(T²), kept for the unroll)."""
    T = q.shape[-2]
    block = cache.causal_block(T, q.device)
    return block if block is not None else cache.additive_mask(T, q.dtype, q.device)


def flash_lse_ttt_attention(
    q: torch.Tensor, cache: TTTCache, scale: float, kernel=None, chunk: int | None = None
) -> torch.Tensor:
    """The efficient TTT attention; ``kernel`` defaults to the fused CPU kernel on CPU, the chunked one elsewhere;
    ``chunk``: slots whose diagonal columns are processed at once (default :data:`DEFAULT_DIAGONAL_CHUNK`, read at
    call time)."""
    kernel = kernel or default_kernel(q)
    chunk = DEFAULT_DIAGONAL_CHUNK if chunk is None else chunk
    if chunk < 1:
        raise ValueError(f"flash_lse diagonal chunk must be a positive number of slots, got chunk={chunk}")
    mask = step_zero_rule(cache, q)
    later = (*cache.keys[1:], *cache.values[1:])
    steps = len(cache) - 1
    return _LSEMergedTTTAttention.apply(q, cache.keys[0], cache.values[0], mask, scale, kernel, chunk, steps, *later)


# ---- concatenated keys: sdpa_mask and flex_attention ---------------------------------------------------------------
def concatenated_kv(cache: TTTCache) -> tuple[torch.Tensor, torch.Tensor]:
    """``[K_0 ; K_1 ; … ; K_k]`` and ``[V_0 ; … ; V_k]`` along the key axis: ``[B,n,T·(k+1),d]``.

    Key ``j`` of step ``i`` sits at index ``i·T + j``. The copy is O(k·T) per step and the attention op saves it for
    backward, so over a K-step unroll these backends keep ``K(K+1)/2`` key/value blocks (flash_lse keeps ``K``)."""
    if len(cache) == 1:
        return cache.keys[0], cache.values[0]
    return torch.cat(cache.keys, dim=-2), torch.cat(cache.values, dim=-2)


def ttt_boolean_mask(cache: TTTCache, T: int, device: torch.device) -> torch.Tensor:
    """``[B|1,1,T,T·(k+1)]`` bool over the concatenated keys: the causal ∧ key-not-pad block over ``K_0`` (every row
    allows key 0) followed by one identity block per later step (slot t sees its own key of that step)."""
    block = cache.allowed_mask(T, device)
    steps = len(cache) - 1
    if not steps:
        return block
    eye = torch.eye(T, dtype=torch.bool, device=device).expand(*block.shape[:2], T, T)
    return torch.cat([block, *[eye] * steps], dim=-1)


def sdpa_mask_ttt_attention(q: torch.Tensor, cache: TTTCache, scale: float) -> torch.Tensor:
    """One SDPA call over the concatenated keys with the boolean TTT mask (d_v may differ from d_qk).

    Memory: the mask is ``B·T·T·(k+1)`` bytes (heads broadcast; 134 MB per row at T = 4096, k = 7), which the CUDA
    memory-efficient kernel turns into an additive bias of the same shape in q's dtype; no ``[B,n,T,T·(k+1)]`` tensor
    on CUDA. Where SDPA falls back to its math path (CPU with d_qk ≠ d_v, fp64) the scores are materialised. Not a
    long-context backend (use ``flash_lse``)."""
    keys, values = concatenated_kv(cache)
    mask = ttt_boolean_mask(cache, q.shape[-2], q.device)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)


def ttt_mask_mod(attention_mask: torch.Tensor | None, T: int, device: torch.device | str = "cpu"):
    """flex ``mask_mod(b, h, q, kv)`` of the TTT row over the concatenated keys (the rule of :func:`ttt_boolean_mask`):

    * ``kv < T`` (step-0 block): ``kv ≤ q`` ∧ key ``kv`` not padding; a padding query row allows key 0 only;
    * ``kv ≥ T`` (later steps): ``kv mod T = q`` — the query's own slot in each later step.

    Indices into the ``[B,T]`` padding mask use ``kv mod T`` so that no index is ever out of range (the tile
    evaluation visits every kv of a partially masked tile). ``T`` is captured as a 0-dim tensor on ``device``, not as
    a Python int: the compiled kernel then takes it as an input instead of specialising (and recompiling) on every
    sequence length."""
    keep = None if attention_mask is None else attention_mask.to(device=device, dtype=torch.bool)
    length = torch.tensor(T, device=device)

    def mask_mod(b, h, q_idx, kv_idx):
        slot = kv_idx % length
        later = (kv_idx >= length) & (slot == q_idx)
        causal = (kv_idx < length) & (slot <= q_idx)
        if keep is None:
            return causal | later
        block = torch.where(keep[b, q_idx], causal & keep[b, slot], kv_idx == 0)
        return block | later

    return mask_mod


def ttt_block_mask(cache: TTTCache, T: int, device: torch.device) -> BlockMask:
    """The flex block mask of this step (KV length ``T·(k+1)``), built once per batch and step count.

    ``create_block_mask`` evaluates ``mask_mod`` densely (``B·T·T·(k+1)`` elements, a few int64/bool intermediates of
    that size: ~1 GB each per row at T = 4096, k = 7, transient, once per batch and step); the kept BlockMask holds only
    128×128-tile indices."""
    attention_mask = cache.attention_mask
    kv_len = T * len(cache)

    def build() -> BlockMask:
        batch = None if attention_mask is None else attention_mask.shape[0]
        return create_block_mask(ttt_mask_mod(attention_mask, T, device), batch, None, T, kv_len, device=device)

    return cache.derived_mask(("flex_block_mask", T, kv_len, torch.device(device)), build)


@functools.cache
def _compiled_flex_attention():
    # flex_attention is only fused under torch.compile; eager flex materialises the scores. The KV length changes with
    # the step (and T with the batch): the default automatic-dynamic compile recompiles once with a dynamic length
    # instead of once per shape (a per-shape compile would hit the recompile limit and silently fall back to eager).
    return torch.compile(flex_attention)


FLEX_CPU_REFUSAL = (
    "the flex_attention TTT backend has no backward on CPU (torch 2.13 raises for flex_attention with inputs that "
    "require grad on CPU); train on CPU with 'sdpa_mask', 'flash_lse' or 'auto', or run flex under torch.no_grad()"
)


def flex_ttt_attention(q: torch.Tensor, cache: TTTCache, scale: float) -> torch.Tensor:
    """flex_attention over the concatenated keys with :func:`ttt_block_mask` (d_v may differ from d_qk).

    CUDA: the compiled (Triton) kernel, forward and backward. CPU: forward only, unfused (checks and inference);
    a call that would need gradients is refused with :data:`FLEX_CPU_REFUSAL` before any work."""
    on_cuda = q.device.type == "cuda"
    if not on_cuda and torch.is_grad_enabled() and any(t.requires_grad for t in (q, *cache.keys, *cache.values)):
        raise NotImplementedError(FLEX_CPU_REFUSAL)
    keys, values = concatenated_kv(cache)
    block_mask = ttt_block_mask(cache, q.shape[-2], q.device)
    if on_cuda:
        return _compiled_flex_attention()(q, keys, values, block_mask=block_mask, scale=scale)
    # No graph is recorded here, but flex's CPU check looks at requires_grad even under no_grad: pass detached views.
    return flex_attention(q.detach(), keys.detach(), values.detach(), block_mask=block_mask, scale=scale)


# ---- per-device choice (the rule: backends.default_ttt_attention) ---------------------------------------------
def resolved_ttt_attention(name: str, device: torch.device | str) -> TTTAttention:
    """The function backend ``name`` runs on ``device`` (``"auto"`` resolved to a concrete backend first)."""
    return _KERNELS[backends.TTT_ATTENTION_BACKEND.resolve(name, device)]


def auto_ttt_attention(q: torch.Tensor, cache: TTTCache, scale: float) -> torch.Tensor:
    """The backend ``"auto"`` resolves to on ``q.device``, at call time (one config for CPU tests and GPU runs)."""
    return resolved_ttt_attention(AUTO, q.device)(q, cache, scale)


_KERNELS.update(
    {
        "eager": eager_ttt_attention,
        "flash_lse": flash_lse_ttt_attention,
        "sdpa_mask": sdpa_mask_ttt_attention,
        "flex_attention": flex_ttt_attention,
        AUTO: auto_ttt_attention,
    }
)
