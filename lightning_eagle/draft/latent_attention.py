"""TTT attention over a cache of MLA latents (the draft setting ``kv_cache``; `eagle3_training.md` §4.1, §8).

``"expanded"`` (default): step i caches its per-head ``K_i [B,n,T,d_qk]``, ``V_i [B,n,T,d_v]`` — ``n·(d_qk+d_v)``
values per token (30 720 for the K3 draft, n = 96).

``"latent"``: step i caches what MLA compresses them from — the normalised KV latent ``c_i [B,1,T,r]`` as
``keys[i]`` and the shared rope key ``ρ_i [B,1,T,d_rope]`` as ``values[i]`` (``r + d_rope`` = 576 values per token for
K3), with ``K_i = [W_uk·c_i ‖ ρ_i]`` and ``V_i = W_uv·c_i`` per head (``kv_b_proj``). With draft activation
checkpointing, only these latents (and the hidden) cross the steps; the expansion happens inside the step:

* ``flash_lse`` (:class:`_LatentLSEMergedTTTAttention`): the step-0 block is expanded once per step (``K_0``, ``V_0``
  — one block; the causal ``T²`` attention runs on the narrow per-head widths, 192 + 128, not on the absorbed 576 +
  512), and the k diagonal columns are computed slot chunk by slot chunk, expanding ``K_i``/``V_i`` of only
  ``chunk`` slots at a time, in the forward and again in the backward. Transient per step: one expanded block plus
  ``k·[B,n,chunk,d_qk+d_v]``, whatever k. FLOPs: the expansion of every cached step is redone per step (and in the
  backward): ``O(K²·T·r·n·(d_nope+d_v))`` for the unroll, small next to the ``T²`` block.
* ``eager`` / ``sdpa_mask`` / ``flex_attention`` (and user backends): every cached step is expanded for the call
  (a transient expanded cache of k+1 blocks) and the backend runs unchanged. These are not long-context backends.

Without activation checkpointing the latent cache saves nothing: autograd keeps each step's expanded ``K_0``/``V_0``
for its backward (K blocks over the unroll, as the expanded cache) — use it with
``model.draft.activation_checkpointing``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_eagle.draft import ttt_attention as tta
from lightning_eagle.draft.block_attention import accumulate_dtype
from lightning_eagle.draft.cache import TTTCache
from lightning_eagle.ops.mla import expand_latent_kv

# The kv_cache names (run_settings.KV_CACHES): "expanded" keeps per-head K/V of every step, n·(d_qk+d_v)
# values per token (the plain twin); "latent" keeps MLA's normalised KV latent + shared rope key, r + d_rope values per
# token, expanded inside each step.
DEFAULT_KV_CACHE = "expanded"


@dataclass(frozen=True)
class LatentKV:
    """How a layer expands its cached latents: ``kv_b_weight [n·(d_nope+d_v), r]`` (``kv_b_proj.weight``)."""

    kv_b_weight: torch.Tensor
    num_heads: int
    qk_nope_head_dim: int

    def expand(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B,1,T,r]``, ``[B,1,T,d_rope]`` → ``K [B,n,T,d_qk]``, ``V [B,n,T,d_v]``."""
        return expand_latent_kv(self.kv_b_weight, latent, k_rope, self.num_heads, self.qk_nope_head_dim)

    @property
    def per_head(self) -> torch.Tensor:
        """``[n, d_nope+d_v, r]``: ``W_uk`` rows first, then ``W_uv`` (a view of the weight)."""
        return self.kv_b_weight.view(self.num_heads, -1, self.kv_b_weight.shape[-1])


def check_latent_cache(q: torch.Tensor, cache: TTTCache, latent_kv: LatentKV) -> None:
    """Every cached step is a latent ``[B,1,T,r]`` and q has every head of ``kv_b_proj`` (shapes only: no sync)."""
    if q.shape[1] != latent_kv.num_heads:
        # A head-sharded layout (sequence parallel) would need kv_b_proj sliced to the rank's heads as well.
        raise ValueError(
            f"kv_cache='latent' expands the latents for all {latent_kv.num_heads} heads, the attention layout "
            f"gave queries with {q.shape[1]}: head-sharded attention (sequence parallel) needs kv_cache='expanded'"
        )
    r = latent_kv.kv_b_weight.shape[-1]
    for key in cache.keys:
        if key.dim() == 4 and key.shape[1] == 1 and key.shape[-1] == r:
            continue
        raise ValueError(
            f"kv_cache='latent' needs a cache of latents [B,1,T,{r}], got keys of shape {tuple(key.shape)} "
            "(a cache must not switch kv_cache within an unroll)"
        )


def expanded_cache(cache: TTTCache, latent_kv: LatentKV) -> TTTCache:
    """The expanded per-head K/V of every cached step, with ``cache``'s mask and derived masks (transient)."""
    expanded = [latent_kv.expand(c, rho) for c, rho in zip(cache.keys, cache.values)]
    return cache.replay([k for k, _ in expanded], [v for _, v in expanded])


def _expand_slots(latent_kv_per_head, latents, ropes, start, end, nope, acc):
    """Later steps' ``K [k,B,n,chunk,d_qk]``, ``V [k,B,n,chunk,d_v]`` of slots ``start:end`` (and the chunk's latents
    ``[k,B,chunk,r]``), in the accumulate dtype."""
    lat = torch.stack([c[:, 0, start:end] for c in latents]).to(acc)
    kv = torch.einsum("sbtr,ndr->sbntd", lat, latent_kv_per_head.to(acc))
    rho = torch.stack([p[:, :, start:end] for p in ropes]).to(acc)  # [k,B,1,chunk,d_rope]
    keys = torch.cat([kv[..., :nope], rho.expand(*kv.shape[:3], -1, -1)], dim=-1)
    return keys, kv[..., nope:], lat


class _LatentLSEMergedTTTAttention(torch.autograd.Function):
    """``flash_lse`` with the later steps as latents: the block kernel on the expanded ``K_0``/``V_0`` and the
    diagonal columns merged through the LSE (as :class:`~lightning_eagle.draft.ttt_attention._LSEMergedTTTAttention`),
    the later steps' ``K_i``/``V_i`` expanded per slot chunk in the forward and recomputed in the backward; the
    backward returns the gradients of the latents, rope keys and ``W_kv`` directly."""

    @staticmethod
    def forward(ctx, q, k0, v0, mask, scale, kernel, chunk, nope, weight, num_diag, *later):
        latents, ropes = later[:num_diag], later[num_diag:]
        acc = accumulate_dtype(q.dtype)
        out_b, lse_b = kernel.forward(q, k0, v0, mask, scale)
        out, lse = torch.empty_like(out_b), torch.empty_like(lse_b)
        T = q.shape[-2]
        for start in range(0, T, chunk):
            end = min(T, start + chunk)
            keys, values, _ = _expand_slots(weight, latents, ropes, start, end, nope, acc)
            diag = torch.einsum("bntc,sbntc->bnts", q[..., start:end, :].to(acc), keys) * scale
            lse_c = torch.logaddexp(lse_b[..., start:end].to(acc), torch.logsumexp(diag, dim=-1))
            o = torch.exp(lse_b[..., start:end].to(acc) - lse_c)[..., None] * out_b[..., start:end, :].to(acc)
            o = o + torch.einsum("bnts,sbntd->bntd", torch.exp(diag - lse_c[..., None]), values)
            out[..., start:end, :], lse[..., start:end] = o, lse_c
        tensor_mask = mask if isinstance(mask, torch.Tensor) else None
        ctx.save_for_backward(q, k0, v0, tensor_mask, out, lse, weight, *later)
        ctx.rule = None if tensor_mask is not None else mask
        ctx.scale, ctx.kernel, ctx.chunk, ctx.nope, ctx.num_diag = scale, kernel, chunk, nope, num_diag
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k0, v0, mask, out, lse, weight, *later = ctx.saved_tensors
        mask = mask if ctx.rule is None else ctx.rule
        scale, chunk, nope, num_diag = ctx.scale, ctx.chunk, ctx.nope, ctx.num_diag
        latents, ropes = later[:num_diag], later[num_diag:]
        dq, dk0, dv0 = ctx.kernel.backward(grad_out, q, k0, v0, mask, out, lse, scale)
        acc = accumulate_dtype(q.dtype)
        dq = dq.to(acc)
        w = weight.to(acc)
        d_weight = torch.zeros_like(w)
        d_lat = torch.zeros(num_diag, *latents[0][:, 0].shape, dtype=acc, device=q.device)  # [k,B,T,r]
        d_rope = torch.zeros(num_diag, *ropes[0].shape, dtype=acc, device=q.device)  # [k,B,1,T,d_rope]
        T = q.shape[-2]
        for start in range(0, T, chunk):
            end = min(T, start + chunk)
            keys, values, lat = _expand_slots(weight, latents, ropes, start, end, nope, acc)
            q_c, do = q[..., start:end, :].to(acc), grad_out[..., start:end, :].to(acc)
            probs = torch.exp(torch.einsum("bntc,sbntc->bnts", q_c, keys) * scale - lse[..., start:end, None].to(acc))
            delta = (do * out[..., start:end, :].to(acc)).sum(-1, keepdim=True)
            ds = probs * (torch.einsum("bntd,sbntd->bnts", do, values) - delta)
            dq[..., start:end, :] += torch.einsum("bnts,sbntc->bntc", ds, keys) * scale
            d_keys = torch.einsum("bnts,bntc->sbntc", ds, q_c) * scale
            d_kv = torch.cat([d_keys[..., :nope], torch.einsum("bnts,bntd->sbntd", probs, do)], dim=-1)
            d_lat[:, :, start:end] = torch.einsum("sbntd,ndr->sbtr", d_kv, w)
            d_weight += torch.einsum("sbntd,sbtr->ndr", d_kv, lat)
            d_rope[..., start:end, :] = d_keys[..., nope:].sum(2, keepdim=True)
        grads = [g[:, None].to(c.dtype) for g, c in zip(d_lat.unbind(0), latents)]
        grads += [g.to(p.dtype) for g, p in zip(d_rope.unbind(0), ropes)]
        return (dq.to(q.dtype), dk0, dv0, None, None, None, None, None, d_weight.to(weight.dtype), None, *grads)


def latent_flash_lse_ttt_attention(
    q: torch.Tensor,
    cache: TTTCache,
    scale: float,
    latent_kv: LatentKV,
    kernel=None,
    chunk: int | None = None,
) -> torch.Tensor:
    """``flash_lse`` over a latent cache: the same rows as over the expanded cache (module docstring). ``chunk``: slots
    whose later-step K/V are expanded at once (default: the expanded path's
    :data:`~lightning_eagle.draft.ttt_attention.DEFAULT_DIAGONAL_CHUNK`, read at call time)."""
    kernel = kernel or tta.default_kernel(q)  # the expanded path's choice (one per-device rule)
    chunk = chunk or tta.DEFAULT_DIAGONAL_CHUNK  # one slot-chunk setting for both diagonal paths
    steps = len(cache) - 1
    if not steps:  # plain causal attention over the step's own (expanded) keys: nothing to chunk
        return tta.flash_lse_ttt_attention(q, expanded_cache(cache, latent_kv), scale, kernel=kernel)
    mask = tta.step_zero_rule(cache, q)
    k0, v0 = latent_kv.expand(cache.keys[0], cache.values[0])
    later = (*cache.keys[1:], *cache.values[1:])
    nope = latent_kv.qk_nope_head_dim
    return _LatentLSEMergedTTTAttention.apply(
        q, k0, v0, mask, scale, kernel, chunk, nope, latent_kv.per_head, steps, *later
    )


def latent_ttt_attention(backend: str, q: torch.Tensor, cache: TTTCache, scale: float, latent_kv: LatentKV):
    """The TTT attention of ``backend`` over a latent cache: ``flash_lse`` (also as ``auto``'s choice) expands per slot
    chunk; any other backend runs on the transiently expanded cache."""
    check_latent_cache(q, cache, latent_kv)
    fn = tta.resolved_ttt_attention(backend, q.device)
    if fn is tta.flash_lse_ttt_attention:
        return latent_flash_lse_ttt_attention(q, cache, scale, latent_kv)
    return fn(q, expanded_cache(cache, latent_kv), scale)
