"""Draft module: §3.1 shapes, 2H widths, NoPE (no rotary, position-id invariance), output gate, dtypes, embeddings,
vocab map, fc_norm / norm_output / no-q_lora variants."""

from __future__ import annotations

import pytest
import torch

from lightning_eagle.draft import KimiK3Eagle3Draft, TTTCache
from lightning_eagle.ops.norm import rms_norm

# §3.1, `k3-tiny` draft column (N_d = 72); v_head_dim = 20 in the preset.
K3_TINY_SHAPES = {
    "embed_tokens.weight": (256, 128),
    "fc.weight": (128, 384),
    "midlayer.input_layernorm.weight": (128,),
    "midlayer.hidden_norm.weight": (128,),
    "midlayer.self_attn.q_a_proj.weight": (48, 256),
    "midlayer.self_attn.q_a_layernorm.weight": (48,),
    "midlayer.self_attn.q_b_proj.weight": (96, 48),
    "midlayer.self_attn.kv_a_proj_with_mqa.weight": (40, 256),
    "midlayer.self_attn.kv_a_layernorm.weight": (32,),
    "midlayer.self_attn.kv_b_proj.weight": (144, 32),
    "midlayer.self_attn.g_proj.weight": (80, 256),
    "midlayer.self_attn.o_proj.weight": (128, 80),
    "midlayer.post_attention_layernorm.weight": (128,),
    "midlayer.mlp.gate_proj.weight": (192, 128),
    "midlayer.mlp.up_proj.weight": (192, 128),
    "midlayer.mlp.down_proj.weight": (128, 192),
    "norm.weight": (128,),
    "lm_head.weight": (72, 128),
    "d2t": (72,),
    "t2d": (256,),
}


def run_steps(draft, batch, steps, position_ids=None):
    cache = TTTCache()
    h = draft.project(batch["aux_hidden_states"])
    ids = batch["input_ids"]
    outs = []
    for k in range(steps):
        if k:
            ids = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
        h = draft.layer(ids, h, batch["attention_mask"], cache, position_ids=position_ids)
        outs.append(h)
    return outs


def test_module_shapes_match_spec(make_draft):
    draft = make_draft()
    state = draft.state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == K3_TINY_SHAPES
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    attn = draft.midlayer.self_attn
    assert attn.q_a_proj.in_features == attn.kv_a_proj_with_mqa.in_features == attn.g_proj.in_features == 2 * 128
    assert attn.kv_a_layernorm.eps == attn.q_a_layernorm.eps == draft.config.rms_norm_eps  # draft: 1e-5, not 1e-6


def test_no_rotary_anywhere(make_draft):
    draft = make_draft()
    names = [n for n, _ in draft.named_modules()] + [n for n, _ in draft.named_buffers()]
    assert not any("rotary" in n or "rope" in n or "freqs" in n for n in names)


def test_position_ids_are_ignored(make_draft, make_batch):
    draft = make_draft()
    batch = make_batch(draft.config)
    B, T = batch["input_ids"].shape
    a = run_steps(draft, batch, 3, position_ids=torch.arange(T).expand(B, T))
    b = run_steps(draft, batch, 3, position_ids=torch.arange(T).expand(B, T) + 17)
    c = run_steps(draft, batch, 3)
    for x, y, z in zip(a, b, c):
        assert torch.equal(x, y) and torch.equal(x, z)


def test_output_gate_is_used(make_draft):
    draft = make_draft()
    attn = draft.midlayer.self_attn
    combined = torch.randn(2, 12, 256)
    with torch.no_grad():
        gated = draft.midlayer.attention(combined, TTTCache(), "eager")
        attn.g_proj.weight.zero_()
        half_gate = draft.midlayer.attention(combined, TTTCache(), "eager")
        attn.g_proj = None  # no gate at all
        no_gate = draft.midlayer.attention(combined, TTTCache(), "eager")
    assert not torch.allclose(gated, half_gate)
    # σ(0) = 0.5 and o_proj is linear: a zero gate halves the ungated output.
    torch.testing.assert_close(half_gate, 0.5 * no_gate, rtol=1e-5, atol=1e-6)


def test_fp32_build_then_draft_only_cast(make_draft, make_batch):
    draft = make_draft()
    assert all(p.dtype == torch.float32 for p in draft.parameters())
    draft = draft.to(torch.bfloat16)
    assert draft.d2t.dtype == torch.int64 and draft.t2d.dtype == torch.bool
    assert all(p.dtype == torch.bfloat16 for p in draft.parameters())
    batch = make_batch(draft.config)
    batch["aux_hidden_states"] = batch["aux_hidden_states"].bfloat16()
    for backend in ("eager", "flash_lse"):
        draft.attention_backend = backend
        h = run_steps(draft, batch, 2)[-1]
        assert h.dtype == torch.bfloat16 and torch.isfinite(draft.logits(h)).all()


def test_embeddings_copy_and_freeze(make_draft, make_batch):
    draft = make_draft()
    assert not draft.embed_tokens.weight.requires_grad  # freeze_embeddings defaults to true
    target = torch.randn(256, 128, dtype=torch.bfloat16)
    draft.copy_embeddings_from(target)
    assert torch.equal(draft.embed_tokens.weight, target.float())
    with pytest.raises(ValueError, match="shape"):
        draft.copy_embeddings_from(torch.randn(255, 128))
    batch = make_batch(draft.config)
    draft.logits(run_steps(draft, batch, 2)[-1]).sum().backward()
    assert draft.embed_tokens.weight.grad is None
    assert all(p.grad is not None for n, p in draft.named_parameters() if n != "embed_tokens.weight")
    thawed = make_draft(freeze_embeddings=False)
    assert thawed.embed_tokens.weight.requires_grad


def test_vocab_mapping_invariants(make_draft):
    draft = make_draft()
    selected = torch.tensor(sorted(torch.randperm(256)[:72].tolist()))
    draft.set_vocab_mapping(selected)
    assert int(draft.t2d.sum()) == 72
    assert torch.equal(torch.nonzero(draft.t2d).flatten(), selected)
    assert torch.equal(draft.selected_token_ids, selected)
    assert bool((draft.d2t >= 0).all()) and bool((draft.d2t[1:] >= draft.d2t[:-1]).all())
    with pytest.raises(ValueError, match="ascending"):
        draft.set_vocab_mapping(selected.flip(0))
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        draft.set_vocab_mapping(torch.cat([selected[:-1], torch.tensor([256])]))
    with pytest.raises(ValueError, match="72"):
        draft.set_vocab_mapping(selected[:-1])


def test_default_map_and_identity(make_draft):
    draft = KimiK3Eagle3Draft(make_draft().config)
    assert torch.equal(draft.selected_token_ids, torch.arange(72))
    full = KimiK3Eagle3Draft(make_draft().config.replace(draft_vocab_size=None))
    assert full.lm_head.out_features == 256 and bool(full.t2d.all()) and not bool(full.d2t.any())


def test_packing_mask_rejected(make_draft, make_batch):
    draft = make_draft()
    batch = make_batch(draft.config)
    block = torch.ones(2, 1, 12, 12)
    with pytest.raises(ValueError, match="KimiK3Eagle3Draft does not support sequence packing"):
        draft.layer(batch["input_ids"], draft.project(batch["aux_hidden_states"]), block, TTTCache())


def test_fc_norm_normalises_each_aux_chunk(make_draft, make_batch):
    draft = make_draft(fc_norm=True)
    assert len(draft.fc_norm) == 3
    aux = make_batch(draft.config)["aux_hidden_states"]
    chunks = aux.chunk(3, dim=-1)
    manual = torch.cat([rms_norm(c, n.weight, n.eps) for c, n in zip(chunks, draft.fc_norm)], dim=-1)
    # exact: project runs these very ops on the same shapes
    torch.testing.assert_close(draft.project(aux), draft.fc(manual), rtol=0, atol=0)
    assert not torch.allclose(draft.project(aux), draft.fc(aux))


def test_norm_output_moves_the_final_norm(make_draft, make_batch):
    plain, normed = make_draft(seed=3), make_draft(seed=3, norm_output=True)
    batch = make_batch(plain.config)
    h_plain = run_steps(plain, batch, 1)[0]
    h_normed = run_steps(normed, batch, 1)[0]
    # exact: same seed and weights, same ops on the same shapes; only where the final norm is applied differs
    torch.testing.assert_close(h_normed, plain.norm(h_plain), rtol=0, atol=0)
    torch.testing.assert_close(normed.logits(h_normed), plain.logits(h_plain), rtol=0, atol=0)


def test_without_q_lora(make_draft, make_batch):
    draft = make_draft(q_lora_rank=None)
    assert draft.midlayer.self_attn.q_proj.weight.shape == (4 * 24, 256)
    assert not hasattr(draft.midlayer.self_attn, "q_a_proj")
    assert torch.isfinite(run_steps(draft, make_batch(draft.config), 2)[-1]).all()


def test_unknown_backend_rejected(make_draft):
    with pytest.raises(ValueError, match="unknown TTT attention backend"):
        make_draft().attention_backend = "flex"
