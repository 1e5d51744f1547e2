"""Equivalence with the public reference on ``../shared/golden/target`` through the real loader.

Tolerances from the golden README: logits and final states atol 2e-4 / rtol 1e-4, ``layer_out.0`` 1e-5,
router top-k indices exact. Only positions with ``attention_mask == 1`` are meaningful.
"""

import pytest
import torch
from safetensors.torch import load_file

from lightning_eagle import KimiK3ForCausalLM


@pytest.fixture(scope="module", params=[("chunk", "dequantized"), ("naive", "dequantized"), ("chunk", "mxfp4")])
def golden(request, golden_dir):
    target = golden_dir / "target"
    kda_backend, expert_storage = request.param
    model = KimiK3ForCausalLM.from_pretrained(
        target, dtype=torch.float32, kda_backend=kda_backend, expert_storage=expert_storage
    )
    inputs, expected = load_file(str(target / "inputs.safetensors")), load_file(str(target / "expected.safetensors"))
    layer_outs, prenorm = {}, {}
    handles = [
        layer.register_forward_hook(lambda m, a, o, i=i: layer_outs.__setitem__(i, o[0]))
        for i, layer in enumerate(model.model.layers)
    ]
    handles.append(model.model.norm.register_forward_pre_hook(lambda m, a: prenorm.__setitem__(0, a[0])))
    for layer in model.model.layers[1:]:
        layer.block_sparse_moe.record_routing = True
    try:
        cap = model.capture(inputs["input_ids"], inputs["attention_mask"], aux_layer_ids=None, return_logits=True)
    finally:
        for h in handles:
            h.remove()
    return model, inputs, expected, cap, layer_outs, prenorm[0]


def _close(got, want, valid, atol, rtol):
    torch.testing.assert_close(got[valid], want[valid], atol=atol, rtol=rtol)


def test_logits_and_final_states(golden):
    model, inputs, expected, cap, _, prenorm = golden
    valid = inputs["attention_mask"].bool()
    _close(cap.logits, expected["logits"], valid, 2e-4, 1e-4)
    _close(cap.final_hidden, expected["final_hidden"], valid, 2e-4, 1e-4)
    _close(prenorm, expected["final_prenorm"], valid, 2e-4, 1e-4)


def test_every_layer_output(golden):
    _, inputs, expected, _, layer_outs, _ = golden
    valid = inputs["attention_mask"].bool()
    _close(layer_outs[0], expected["layer_out.0"], valid, 1e-5, 1e-5)
    for i in range(1, 8):
        _close(layer_outs[i], expected[f"layer_out.{i}"], valid, 2e-4, 1e-4)


def test_router_choices_exact(golden):
    model, inputs, expected, *_ = golden
    valid = inputs["attention_mask"].bool().reshape(-1)
    for i in range(1, 8):
        idx, weight = model.model.layers[i].block_sparse_moe.last_routing
        assert torch.equal(idx[valid], expected[f"router.{i}.topk_idx"][valid]), f"router {i}"
        torch.testing.assert_close(weight[valid], expected[f"router.{i}.topk_weight"][valid], atol=1e-5, rtol=1e-5)


def test_eagle3_aux_states_with_default_ids(golden):
    _, inputs, expected, cap, _, _ = golden
    valid = inputs["attention_mask"].bool()
    assert cap.aux_hidden_states.shape == expected["eagle3.aux_hidden_states"].shape
    _close(cap.aux_hidden_states, expected["eagle3.aux_hidden_states"], valid, 2e-4, 1e-4)


def test_block_residual_bank(golden):
    model, inputs, expected, *_ = golden
    bank_out = {}
    last = model.model.layers[-1]
    handle = last.register_forward_hook(lambda m, a, o: bank_out.__setitem__(0, o[1]))
    try:
        model(inputs["input_ids"], inputs["attention_mask"])
    finally:
        handle.remove()
    bank = torch.stack(bank_out[0], dim=2)
    valid = inputs["attention_mask"].bool()
    _close(bank, expected["block_residual_final"], valid, 2e-4, 1e-4)
