"""The deepseek_mla draft (the served-draft variant): config rules, class dispatch, rotary twins and YaRN numbers, the
TTT position convention, and eager ↔ flash_lse / plain ↔ checkpointed twins on the new layer."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from draft_helpers import tiny_batch, tiny_config, tiny_draft

from lightning_eagle.draft import Eagle3DraftConfig, KimiK3Eagle3Draft, TTTCache, build_draft
from lightning_eagle.draft.deepseek_mla import DeepseekMLAEagle3Draft, DeepseekRMSNorm, engine_rms_norm
from lightning_eagle.k3.presets import config_from_name
from lightning_eagle.ops.norm import rms_norm
from lightning_eagle.ops.rotary import (
    InterleavedRotary,
    apply_interleaved_rotary_complex,
    attention_scale,
    rotary_angles,
    rotary_inverse_frequencies,
    rotary_magnitude,
)
from lightning_eagle.training.ttt import checkpointed_draft_step, ttt_loss

YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "mscale": 0.7, "mscale_all_dim": 1.0}


def mla_draft(seed: int = 0, **overrides):
    return tiny_draft(seed=seed, architecture="deepseek_mla", **overrides)


# ---- config ------------------------------------------------------------------------------------------------------
def test_config_from_target_takes_the_deepseek_layer_fields():
    config = tiny_config(architecture="deepseek_mla")
    assert (config.hidden_act, config.mla_use_nope, config.mla_use_output_gate) == ("silu", False, False)
    assert config.activation_situ_beta is None and config.rope_theta == 10000.0 and config.rope_scaling is None
    assert config.max_position_embeddings == config_from_name("k3-tiny").max_position_embeddings
    assert Eagle3DraftConfig.from_dict(config.to_dict()) == config
    yarn = tiny_config(
        architecture="deepseek_mla", rope_scaling={"type": "yarn", "factor": 2, "original_max_position_embeddings": 16}
    )
    assert yarn.rope_scaling == {
        "type": "yarn", "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0,
    }  # fmt: skip


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ({"hidden_act": "situ"}, "hidden_act must be 'silu'"),
        ({"mla_use_output_gate": True}, "no output gate"),
        ({"q_lora_rank": None}, "needs a Q-LoRA"),
        ({"num_key_value_heads": 1}, "one K/V head per query head"),
        ({"qk_rope_head_dim": 7}, "positive even int"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "DeepSeek YaRN only"),
        ({"rope_scaling": {"type": "yarn", "factor": 2.0}}, "original_max_position_embeddings"),
        ({"rope_scaling": {**YARN, "attn_factor": 2.0}}, "keys DeepSeek YaRN does not define"),
        ({"architecture": "llama"}, "architecture must be one of"),
    ],
)
def test_config_refusals(overrides, fragment):
    with pytest.raises(ValueError, match=fragment):
        tiny_config(**{"architecture": "deepseek_mla", **overrides})


def test_k3_config_refuses_rope_and_points_to_deepseek_mla():
    with pytest.raises(ValueError, match="rope_scaling applies to architecture=.deepseek_mla. only"):
        tiny_config(rope_scaling=YARN)
    with pytest.raises(ValueError, match="mla_use_nope.*architecture='deepseek_mla'"):
        tiny_config(mla_use_nope=False)
    with pytest.raises(ValueError, match="SiTU.*architecture='deepseek_mla'"):
        tiny_config(hidden_act="silu")


# ---- model -------------------------------------------------------------------------------------------------------
def test_the_config_picks_the_class_and_its_modules():
    draft = mla_draft()
    assert type(draft) is DeepseekMLAEagle3Draft and isinstance(draft, KimiK3Eagle3Draft)
    assert type(build_draft(tiny_config())) is KimiK3Eagle3Draft
    with pytest.raises(ValueError, match=r"build it with lightning_eagle.draft.build_draft\(config\)"):
        KimiK3Eagle3Draft(draft.config)  # the base class builds only its own architecture
    assert type(copy.deepcopy(draft)) is DeepseekMLAEagle3Draft
    with pytest.raises(ValueError, match="builds architecture='deepseek_mla'"):
        DeepseekMLAEagle3Draft(tiny_config())
    names = set(draft.state_dict())
    assert "midlayer.self_attn.g_proj.weight" not in names
    assert {"midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight"} <= names
    assert not any("inv_freq" in n for n in names)  # the rotary tables are rebuilt from the config, never stored
    assert all(isinstance(m, DeepseekRMSNorm) for n, m in draft.named_modules() if n.endswith(("norm", "layernorm")))
    with torch.device("meta"):
        meta = build_draft(draft.config)
    meta.load_state_dict(draft.state_dict(), assign=True)
    assert not any(t.is_meta for t in [*meta.parameters(), *meta.buffers()])


def test_engine_rms_norm_order():
    """Weight product in fp32 and one cast (SGLang's order): equal to K3's norm in fp32; in bf16 it is the one
    rounding of the exact product."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 256, generator=g), torch.rand(256, generator=g) + 0.5
    torch.testing.assert_close(engine_rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5), rtol=0, atol=0)
    xb, wb = x.bfloat16(), w.bfloat16()
    exact = (xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1e-5)) * wb.float()
    assert torch.equal(engine_rms_norm(xb, wb, 1e-5), exact.bfloat16())
    assert engine_rms_norm(xb, wb, 1e-5).dtype == torch.bfloat16


# ---- rotary ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rope_scaling", [None, YARN])
def test_rotary_real_and_complex_twins(rope_scaling):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 11, 16, generator=g, dtype=torch.float64).float()
    positions = torch.tensor([0, 1, 2, 5, 9, 40, 41, 100, 1000, 4095, 70000])
    rotary = InterleavedRotary(16, 5000.0, rope_scaling)
    angles = rotary_angles(positions, rotary_inverse_frequencies(16, 5000.0, rope_scaling))
    twin = apply_interleaved_rotary_complex(x, angles, rotary_magnitude(rope_scaling))
    torch.testing.assert_close(rotary(x, positions), twin, rtol=1e-5, atol=1e-5)
    # The pairs are (2i, 2i+1): pair 0 at position p is rotated by exactly p radians (θ_0 = 1, kept by YaRN).
    m = rotary_magnitude(rope_scaling)
    p = positions[5].item()
    e, o = x[..., 5, 0], x[..., 5, 1]
    out = rotary(x, positions)[..., 5, :2]
    c, s = math.cos(p), math.sin(p)
    torch.testing.assert_close(out, torch.stack([m * (e * c - o * s), m * (o * c + e * s)], -1), rtol=1e-5, atol=1e-5)


def test_rotation_depends_on_relative_position_only():
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 1, 6, 8, generator=g), torch.randn(1, 1, 6, 8, generator=g)
    rotary = InterleavedRotary(8, 10000.0, YARN)
    pos = torch.arange(6)
    scores = rotary(q, pos) @ rotary(k, pos).transpose(-1, -2)
    shifted = rotary(q, pos + 37) @ rotary(k, pos + 37).transpose(-1, -2)
    torch.testing.assert_close(scores, shifted, rtol=1e-4, atol=1e-4)


def test_deepseek_yarn_numbers():
    # DeepSeek-V3: d_qk 192, factor 40, mscale = mscale_all_dim = 1 → softmax scale 192^-½ · (0.1 ln 40 + 1)².
    v3 = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0}
    assert attention_scale(192, v3) == pytest.approx(192**-0.5 * (0.1 * math.log(40) + 1) ** 2)
    assert rotary_magnitude(v3) == 1.0
    assert attention_scale(192, {**v3, "mscale_all_dim": 0.0}) == pytest.approx(192**-0.5)  # DeepSeek's default
    assert rotary_magnitude(YARN) == pytest.approx((0.07 * math.log(4) + 1) / (0.1 * math.log(4) + 1))
    # Fast pairs keep θ_i, slow pairs are interpolated by 1/factor, between lies the ramp (d = 64, β 32 / 1).
    theta = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    inv = rotary_inverse_frequencies(64, 10000.0, v3)
    lo = math.floor(64 * math.log(4096 / (32 * 2 * math.pi)) / (2 * math.log(10000)))
    hi = math.ceil(64 * math.log(4096 / (1 * 2 * math.pi)) / (2 * math.log(10000)))
    assert 0 < lo < hi < 31
    torch.testing.assert_close(inv[: lo + 1], theta[: lo + 1])
    torch.testing.assert_close(inv[hi:], theta[hi:] / 40)
    assert bool(((inv[lo + 1 : hi] < theta[lo + 1 : hi]) & (inv[lo + 1 : hi] > theta[lo + 1 : hi] / 40)).all())
    assert torch.equal(rotary_inverse_frequencies(64, 10000.0, None), theta)


# ---- the TTT step ------------------------------------------------------------------------------------------------
def test_ttt_step_k_rotates_at_t_plus_k():
    """Queries and appended keys of step k stand at position t + k (module docstring of draft.deepseek_mla)."""
    draft = mla_draft(rope_scaling=YARN)
    batch = tiny_batch(draft.config)
    seen = []
    draft.midlayer.self_attn.rotary.register_forward_pre_hook(lambda mod, args: seen.append(args[1].clone()))
    cache, h, ids = TTTCache(), draft.project(batch["aux_hidden_states"]), batch["input_ids"]
    with torch.no_grad():
        for _ in range(3):
            h = draft.layer(ids, h, batch["attention_mask"], cache)
    T = ids.shape[1]
    assert [p.tolist() for p in seen] == [list(range(k, k + T)) for k in range(3) for _ in ("q", "k")]


@torch.no_grad()
def test_positions_matter_only_through_their_differences():
    draft = mla_draft(rope_scaling=YARN)
    batch = tiny_batch(draft.config)
    T = batch["input_ids"].shape[1]

    def unroll(offsets):
        cache, h, out = TTTCache(), draft.project(batch["aux_hidden_states"]), []
        for k, offset in enumerate(offsets):
            h = draft.layer(
                batch["input_ids"], h, batch["attention_mask"], cache, position_ids=torch.arange(T) + offset
            )
            out.append(draft.logits(h))
        return torch.stack(out)

    default = unroll([0, 1, 2])
    torch.testing.assert_close(unroll([100, 101, 102]), default, rtol=1e-4, atol=1e-4)  # a common shift: same
    assert (unroll([0, 0, 0])[1:] - default[1:]).abs().max() > 1e-3  # no per-step offset: another function
    # The default positions are the TTT convention t + k.
    cache, h = TTTCache(), draft.project(batch["aux_hidden_states"])
    ours = []
    for _ in range(3):
        h = draft.layer(batch["input_ids"], h, batch["attention_mask"], cache)
        ours.append(draft.logits(h))
    torch.testing.assert_close(torch.stack(ours), default, rtol=0, atol=0)


def _loss_and_grads(draft, batch, **kwargs):
    draft.zero_grad()
    out = ttt_loss(
        draft, batch["input_ids"], batch["attention_mask"], batch["loss_mask"], batch["aux_hidden_states"],
        batch["target_logits"], ttt_steps=4, **kwargs,
    )  # fmt: skip
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("rope_scaling", [None, YARN])
def test_eager_and_flash_lse_agree_forward_and_backward(rope_scaling):
    draft = mla_draft(rope_scaling=rope_scaling)
    batch = tiny_batch(draft.config)
    loss_e, grads_e = _loss_and_grads(draft, batch)
    draft.attention_backend = "flash_lse"
    loss_f, grads_f = _loss_and_grads(draft, batch)
    torch.testing.assert_close(loss_f, loss_e, rtol=1e-5, atol=1e-6)
    assert grads_e.keys() == grads_f.keys() and "midlayer.self_attn.q_b_proj.weight" in grads_e
    for name in grads_e:
        torch.testing.assert_close(grads_f[name], grads_e[name], rtol=1e-4, atol=1e-6, msg=name)


def test_checkpointed_step_equals_plain_step():
    draft = mla_draft(rope_scaling=YARN)
    batch = tiny_batch(draft.config)
    loss_p, grads_p = _loss_and_grads(draft, batch)
    loss_c, grads_c = _loss_and_grads(draft, batch, draft_step_fn=checkpointed_draft_step)
    torch.testing.assert_close(loss_c, loss_p, rtol=0, atol=0)
    for name in grads_p:
        torch.testing.assert_close(grads_c[name], grads_p[name], rtol=1e-6, atol=1e-7, msg=name)


def test_bf16_draft_trains():
    draft = mla_draft(dtype=torch.bfloat16, rope_scaling=YARN)
    batch = tiny_batch(draft.config)
    batch["aux_hidden_states"] = batch["aux_hidden_states"].bfloat16()
    loss, grads = _loss_and_grads(draft, batch)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() and g.dtype == torch.bfloat16 for g in grads.values())
    assert draft.d2t.dtype == torch.long and draft.t2d.dtype == torch.bool
