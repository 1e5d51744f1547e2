"""Whole-model behaviour: AttnRes stream, padding, EAGLE-3 capture (spec k3_target §2.7–2.9, §3, §6)."""

import pytest
import torch
from k3_helpers import tiny_model

from lightning_eagle.aux_layers import resolve_aux_layer_ids
from lightning_eagle.k3.attn_res import attn_res_mix, res_weights


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_attn_res_mix_properties():
    norm, proj = res_weights(8, 1e-5)
    prefix, bank = torch.randn(3, 8), [torch.randn(3, 8), torch.randn(3, 8)]
    torch.testing.assert_close(attn_res_mix(prefix, bank, norm, proj), (prefix + bank[0] + bank[1]) / 3)
    with torch.no_grad():
        proj.weight.normal_()
    values = torch.stack([*bank, prefix], -2)
    keys = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + 1e-5)
    pi = torch.softmax(keys @ (norm.weight * proj.weight[0]), -1)
    torch.testing.assert_close(pi.sum(-1), torch.ones(3))
    torch.testing.assert_close(attn_res_mix(prefix, bank, norm, proj), (pi[..., None] * values).sum(-2))


def test_bank_commits_and_layer0_reads_raw_embedding(model):
    ids = torch.randint(0, 256, (1, 10))
    banks, inputs = [], {}
    layers = model.model.layers
    handles = [layers[0].input_layernorm.register_forward_pre_hook(lambda m, a: inputs.setdefault(0, a[0]))]
    handles += [layer.register_forward_hook(lambda m, a, o: banks.append(len(o[1]))) for layer in layers]
    model(ids)
    for h in handles:
        h.remove()
    assert banks == [i // 2 + 1 for i in range(6)]  # block size 2: commits at layers 0, 2, 4
    assert torch.equal(inputs[0], model.model.embed_tokens(ids))  # exact: an embedding lookup is a row copy


def test_output_mixer_runs_before_final_norm_and_split_at_block_boundary(model):
    ids = torch.randint(0, 256, (2, 9))
    full = model(ids).logits
    h, bank = model.model.embed_tokens(ids), []
    for layer in model.model.layers[:2]:  # stage 1 ends at a block boundary
        h, bank = layer(h, bank)
    for layer in model.model.layers[2:]:
        h, bank = layer(h, bank)
    mixed = attn_res_mix(h, bank, model.model.output_attn_res_norm, model.model.output_attn_res_proj)
    # exact: a replay of forward's own ops on the same input and shapes (the split itself must not change anything)
    assert torch.equal(model.lm_head(model.model.norm(mixed)), full)
    assert not torch.allclose(model.lm_head(model.model.norm(h)), full)


@pytest.mark.parametrize("preset", ["k3-tiny", "k3-tiny-no-attnres", "k3-tiny-partial-block", "k3-tiny-trailing-mla"])
def test_right_padding_equals_unpadded_rows(preset):
    m = tiny_model(preset)
    a, b = torch.randint(0, 256, (1, 14)), torch.randint(0, 256, (1, 9))
    batch = torch.cat([a, torch.cat([b, torch.zeros(1, 5, dtype=torch.long)], 1)])
    mask = torch.tensor([[1] * 14, [1] * 9 + [0] * 5])
    out = m(batch, attention_mask=mask).logits
    torch.testing.assert_close(out[0:1], m(a).logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1:2, :9], m(b).logits, rtol=1e-5, atol=1e-5)


def test_left_padding_is_supported(model):
    b = torch.randint(0, 256, (1, 9))
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), b], 1)
    out = model(padded, attention_mask=torch.tensor([[0] * 4 + [1] * 9])).logits
    torch.testing.assert_close(out[:, 4:], model(b).logits, rtol=1e-5, atol=1e-5)


def test_no_attnres_variant_has_no_res_parameters():
    m = tiny_model("k3-tiny-no-attnres")
    assert not [n for n, _ in m.named_parameters() if "_res_" in n]


def test_aux_id_validation():
    assert resolve_aux_layer_ids(None, 93) == [1, 45, 89]
    assert resolve_aux_layer_ids(None, 8) == [1, 3, 4]
    fragment = r"default EAGLE-3 aux_layer_ids .* \[1, 2, 2\] are invalid .* pass aux_layer_ids"
    with pytest.raises(ValueError, match=fragment):
        resolve_aux_layer_ids(None, 6)
    for bad, fragment in (([1, 3], "expected 3 ids"), ([1, 3, 3], "distinct"), ([1, 3, 7], r"in \[0, 6\]")):
        with pytest.raises(ValueError, match=fragment):
            resolve_aux_layer_ids(bad, 6)


def test_capture_prefix_mixed_and_final_norm_input(model):
    ids = torch.randint(0, 256, (2, 8))
    layers = model.model.layers
    outs, a_in, norm_in = {}, {}, {}
    handles = [
        layer.register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(i, o[0])) for i, layer in enumerate(layers)
    ]
    handles += [
        layer.input_layernorm.register_forward_pre_hook(lambda m, a, i=i: a_in.__setitem__(i, a[0]))
        for i, layer in enumerate(layers)
    ]
    handles.append(model.model.norm.register_forward_pre_hook(lambda m, a: norm_in.__setitem__(0, a[0])))
    ref = model(ids)
    for h in handles:
        h.remove()
    H = 128
    cap = model.capture(ids, aux_layer_ids=[1, 3, 6], return_logits=True)
    assert cap.aux_hidden_states.shape == (2, 8, 3 * H)
    # exact: capture taps the same forward (same input and shapes) that the hooks above watched; nothing is recomputed
    torch.testing.assert_close(cap.aux_hidden_states[..., :H], outs[1], rtol=0, atol=0)
    torch.testing.assert_close(cap.aux_hidden_states[..., H : 2 * H], outs[3], rtol=0, atol=0)
    torch.testing.assert_close(cap.aux_hidden_states[..., 2 * H :], norm_in[0], rtol=0, atol=0)  # id L
    assert not torch.allclose(cap.aux_hidden_states[..., 2 * H :], outs[5])  # never layer L-1's output
    torch.testing.assert_close(cap.final_hidden, ref.hidden_states, rtol=0, atol=0)
    torch.testing.assert_close(cap.logits, ref.logits, rtol=0, atol=0)
    mixed = model.capture(ids, aux_layer_ids=[3, 1, 5], aux_stream="mixed")
    torch.testing.assert_close(mixed.aux_hidden_states[..., :H], a_in[4], rtol=0, atol=0)
    torch.testing.assert_close(mixed.aux_hidden_states[..., H : 2 * H], a_in[2], rtol=0, atol=0)
    torch.testing.assert_close(mixed.aux_hidden_states[..., 2 * H :], norm_in[0], rtol=0, atol=0)
    assert model.capture(ids, aux_layer_ids=[1, 3, 5]).logits is None
    assert not model.model.norm._forward_pre_hooks and not any(layer._forward_hooks for layer in layers)


def test_logits_to_keep_and_frozen(model):
    ids = torch.randint(0, 256, (1, 7))
    # lm_head over 2 rows vs over 7: GEMM blocking may differ in the last bit on other CPUs, so fp32 tolerance
    torch.testing.assert_close(model(ids, logits_to_keep=2).logits, model(ids).logits[:, -2:], rtol=1e-5, atol=1e-6)
    assert not any(p.requires_grad for p in model.parameters()) and not model.training


def test_cast_keeps_fp32_islands():
    m = tiny_model().cast_to(torch.bfloat16)
    dtypes = {n: p.dtype for n, p in m.named_parameters()}
    assert dtypes["model.layers.0.self_attn.A_log"] == torch.float32
    assert dtypes["model.layers.0.self_attn.q_conv1d.weight"] == torch.float32
    assert dtypes["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"] == torch.float32
    assert dtypes["model.layers.0.self_attn.o_norm.weight"] == torch.float32
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == torch.bfloat16
    assert dtypes["model.layers.1.block_sparse_moe.experts.gate_up_proj"] == torch.bfloat16
    logits = m(torch.randint(0, 256, (1, 5))).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
