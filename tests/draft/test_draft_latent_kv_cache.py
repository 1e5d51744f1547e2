"""``kv_cache: latent`` (the MLA latent + rope key cached per TTT step) against ``expanded`` (the plain twin).

* the setting: default, validation, build_draft / from_pretrained, the deepseek_mla refusal;
* MLA's ``project`` is ``expand_latent ∘ project_latent`` bit for bit (the target's path is unchanged);
* attention level: latent ``flash_lse`` (both block kernels, several slot chunks) == eager over the expanded cache,
  forward and backward (q, every latent, every rope key, ``kv_b_proj.weight``), fp64;
* the whole unroll (K = 3, B = 2 with padding): latent with eager / flash_lse / sdpa_mask, plain and checkpointed,
  == expanded eager (loss, each step's output, every draft gradient); flex forward;
* the cache holds only ``[B,1,T,r]`` latents and ``[B,1,T,d_rope]`` rope keys.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_eagle.draft import TTTCache, build_draft
from lightning_eagle.draft import ttt_attention as tta
from lightning_eagle.draft.block_attention import ChunkedKernel, CpuFlashKernel
from lightning_eagle.draft.deepseek_mla import DeepseekMLAEagle3Draft
from lightning_eagle.draft.latent_attention import LatentKV, expanded_cache, latent_flash_lse_ttt_attention
from lightning_eagle.draft.ttt_attention import eager_ttt_attention
from lightning_eagle.training import ttt_loss
from lightning_eagle.training.ttt import checkpointed_draft_step

B, N, T, R, D_NOPE, D_ROPE, D_V = 2, 3, 7, 10, 6, 4, 5


# ---- the setting --------------------------------------------------------------------------------------------------
def test_setting_default_validation_and_builders(make_draft):
    draft = make_draft()
    assert draft.kv_cache == "expanded"
    with pytest.raises(ValueError, match=r"kv_cache must be one of 'expanded', 'latent', got 'compressed'"):
        draft.kv_cache = "compressed"
    assert draft.kv_cache == "expanded"
    draft.kv_cache = "latent"
    assert build_draft(draft.config, kv_cache="latent").kv_cache == "latent"
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        build_draft(draft.config, kv_cache="nope")


def test_from_pretrained_takes_the_setting(make_draft, tmp_path):
    from lightning_eagle.draft.export import export_draft

    draft = make_draft()
    export_draft(draft, tmp_path / "export")
    embedding = draft.embed_tokens.weight
    loaded = type(draft).from_pretrained(tmp_path / "export", target_embedding=embedding, kv_cache="latent")
    assert loaded.kv_cache == "latent"


def test_deepseek_mla_draft_refuses_latent(make_draft):
    from draft_helpers import tiny_config

    config = tiny_config(architecture="deepseek_mla")
    with pytest.raises(ValueError, match="kv_cache='latent' is not supported by the 'deepseek_mla' draft"):
        build_draft(config, kv_cache="latent")
    draft = build_draft(config)
    assert isinstance(draft, DeepseekMLAEagle3Draft)
    with pytest.raises(ValueError, match="DeepseekMLAEagle3Layer has no latent K/V form"):
        draft.kv_cache = "latent"


def test_project_is_expand_of_project_latent(make_draft):
    """The refactored projection is bit-identical (the frozen target uses the same NoPEMLA)."""
    attn = make_draft().midlayer.self_attn
    x = torch.randn(2, 5, attn.kv_a_proj_with_mqa.in_features)
    q, k, v = attn.project(x)
    q2, latent, k_rot = attn.project_latent(x)
    assert latent.shape == (2, 1, 5, attn.kv_lora_rank) and k_rot.shape == (2, 1, 5, attn.qk_rope_head_dim)
    k2, v2 = attn.expand_latent(latent, k_rot)
    assert torch.equal(q, q2) and torch.equal(k, k2) and torch.equal(v, v2)


# ---- attention level ----------------------------------------------------------------------------------------------
def latent_inputs(steps, seed=0):
    g = torch.Generator().manual_seed(seed)

    def leaf(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    q = leaf(B, N, T, D_NOPE + D_ROPE)
    latents = [leaf(B, 1, T, R) for _ in range(steps + 1)]
    ropes = [leaf(B, 1, T, D_ROPE) for _ in range(steps + 1)]
    weight = leaf(N * (D_NOPE + D_V), R)
    probe = torch.randn(B, N, T, D_V, generator=g, dtype=torch.float64)
    return q, latents, ropes, weight, probe


def run_latent(fn, q, latents, ropes, weight, probe, mask):
    cache = TTTCache()
    cache.bind_mask(mask)
    for c, rho in zip(latents, ropes):
        cache.append(c, rho)
    out = fn(q, cache, 0.3, LatentKV(weight, N, D_NOPE))
    grads = torch.autograd.grad((out * probe).sum(), [q, *latents, *ropes, weight])
    return out.detach(), grads


def eager_over_expanded(q, cache, scale, latent_kv):
    return eager_ttt_attention(q, expanded_cache(cache, latent_kv), scale)


@pytest.mark.parametrize("kernel", [CpuFlashKernel(), ChunkedKernel(chunk_size=3)], ids=["cpu_flash", "chunked"])
@pytest.mark.parametrize("steps", [0, 1, 3])
@pytest.mark.parametrize("chunk", [2, 512], ids=["chunks", "one-chunk"])
@pytest.mark.parametrize("padding", ["right", "left"])
def test_latent_flash_lse_matches_eager_forward_and_backward(kernel, steps, chunk, padding):
    mask = torch.ones(B, T, dtype=torch.long)
    if padding == "right":
        mask[1, 5:] = 0
    else:
        mask[1, :2] = 0

    def latent_flash(q, cache, scale, latent_kv):
        return latent_flash_lse_ttt_attention(q, cache, scale, latent_kv, kernel=kernel, chunk=chunk)

    inputs = latent_inputs(steps)
    (out_a, grads_a), (out_b, grads_b) = (
        run_latent(latent_flash, *inputs, mask),
        run_latent(eager_over_expanded, *inputs, mask),
    )
    torch.testing.assert_close(out_a, out_b, rtol=0, atol=1e-12)
    for i, (ga, gb) in enumerate(zip(grads_a, grads_b, strict=True)):
        torch.testing.assert_close(ga, gb, rtol=0, atol=1e-11, msg=lambda m, i=i: f"gradient {i}: {m}")


# ---- the draft ----------------------------------------------------------------------------------------------------
def unroll(draft, batch, checkpointed, K=3):
    """Loss, every step's hidden and every draft gradient of a K-step ttt_loss; also the cache of the first step."""
    steps, caches = [], []

    def step(draft, input_ids, hidden, attention_mask, cache):
        fn = checkpointed_draft_step if checkpointed else type(draft).layer
        out = fn(draft, input_ids, hidden, attention_mask, cache)
        steps.append(out.detach())
        caches.append(cache)
        return out

    draft.zero_grad(set_to_none=True)
    out = ttt_loss(draft, **batch, ttt_steps=K, draft_step_fn=step)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    return out.loss.detach(), steps, grads, caches[0]


@pytest.mark.parametrize("backend", ["eager", "flash_lse", "sdpa_mask"])
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_latent_unroll_matches_expanded(make_draft, make_batch, monkeypatch, backend, checkpointed):
    monkeypatch.setattr(tta, "DEFAULT_DIAGONAL_CHUNK", 4)  # several slot chunks at T = 10
    draft = make_draft(dtype=torch.float64)
    batch = {k: v.double() if v.is_floating_point() else v for k, v in make_batch(draft.config, T=10).items()}
    draft.attention_backend = "eager"
    loss_a, steps_a, grads_a, _ = unroll(draft, batch, checkpointed=False)
    draft.attention_backend, draft.kv_cache = backend, "latent"
    loss_b, steps_b, grads_b, cache = unroll(draft, batch, checkpointed)
    c = draft.config
    assert [tuple(k.shape) for k in cache.keys] == [(2, 1, 10, c.kv_lora_rank)] * 3
    assert [tuple(v.shape) for v in cache.values] == [(2, 1, 10, c.qk_rope_head_dim)] * 3
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=1e-12)
    for k, (a, b) in enumerate(zip(steps_a, steps_b, strict=True)):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12, msg=lambda m, k=k: f"step {k}: {m}")
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 5
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-10, atol=1e-12, msg=name)


def test_latent_flex_forward_matches_expanded(make_draft, make_batch):
    draft = make_draft(dtype=torch.float64)
    batch = {k: v.double() if v.is_floating_point() else v for k, v in make_batch(draft.config, T=10).items()}
    outputs = []
    for backend, kv_cache in (("eager", "expanded"), ("flex_attention", "latent")):
        draft.attention_backend, draft.kv_cache = backend, kv_cache
        hidden, cache, steps = draft.project(batch["aux_hidden_states"]), TTTCache(), []
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager flex on CPU warns that it is unfused
            for _ in range(3):
                hidden = draft.layer(batch["input_ids"], hidden, batch["attention_mask"], cache)
                steps.append(hidden)
        outputs.append(steps)
    for a, b in zip(*outputs, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)


def test_a_latent_cache_refuses_an_expanded_entry(make_draft, make_batch):
    """Switching kv_cache within one unroll is refused, not silently mixed."""
    draft = make_draft()
    batch = make_batch(draft.config, T=6)
    hidden, cache = draft.project(batch["aux_hidden_states"]), TTTCache()
    hidden = draft.layer(batch["input_ids"], hidden, batch["attention_mask"], cache)
    draft.kv_cache = "latent"
    with pytest.raises(ValueError, match="needs a cache of latents"):
        draft.layer(batch["input_ids"], hidden, batch["attention_mask"], cache)
