"""Final-norm selection keyed on the text config (chat spec §9.3)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from lightning_eagle.data import select_final_norm_type
from lightning_eagle.data.final_norm import (
    FINAL_NORM_TYPES,
    K3_FINAL_NORM_KEY,
    FinalNorm,
    apply_final_norm,
    build_final_norm,
    load_final_norm_weight,
)


@pytest.mark.parametrize(
    ("model_type", "expected"),
    [
        ("kimi_linear", "rmsnorm"),
        ("kimi_k3", None),
        ("gpt_oss", None),
        ("gemma", None),
        ("", None),
        (None, None),
        ("llama", "rmsnorm"),
        ("deepseek_v3", "rmsnorm"),
        ("minimax_m3_vl_text", "gemma_rmsnorm"),
    ],
)
def test_table(model_type, expected):
    assert select_final_norm_type({"model_type": model_type}) == expected
    assert select_final_norm_type(SimpleNamespace(model_type=model_type)) == expected


def test_kimi_k3_is_not_a_key_and_lookup_uses_the_text_config():
    assert "kimi_k3" not in FINAL_NORM_TYPES and "gpt_oss" not in FINAL_NORM_TYPES
    k3 = {"model_type": "kimi_k3", "text_config": {"model_type": "kimi_linear"}}
    assert select_final_norm_type(k3) == "rmsnorm"
    assert select_final_norm_type({"model_type": "llava", "llm_config": {"model_type": "qwen2"}}) == "rmsnorm"
    assert select_final_norm_type(None) is None


def test_use_gemma_norm_override():
    assert select_final_norm_type({"model_type": "llama", "use_gemma_norm": True}) == "gemma_rmsnorm"
    assert select_final_norm_type({"text_config": {"model_type": "foo", "use_gemma_norm": True}}) == "gemma_rmsnorm"
    assert select_final_norm_type({"model_type": "llama", "use_gemma_norm": False}) == "rmsnorm"


def test_golden_target_config_selects_rmsnorm(golden_dir):
    config = json.loads((golden_dir / "target" / "config.json").read_text())
    assert config["model_type"] == "kimi_k3"
    assert select_final_norm_type(config) == "rmsnorm"
    norm = build_final_norm(config, dtype=torch.bfloat16)
    assert norm.weight.shape == (config["text_config"]["hidden_size"],) and norm.weight.dtype == torch.bfloat16
    assert norm.eps == config["text_config"]["rms_norm_eps"]


def test_golden_prenorm_reconstruction(golden_dir):
    """lm_head(norm(final_prenorm)) reproduces the reference logits; norm(a layer output) does not."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    target = golden_dir / "target"
    config = json.loads((target / "config.json").read_text())
    expected = load_file(str(target / "expected.safetensors"))
    norm = load_final_norm_weight(build_final_norm(config), target / "model.safetensors")
    with safe_open(str(target / "model.safetensors"), "pt") as f:
        lm_head = f.get_tensor("language_model.lm_head.weight").float()
    hidden = apply_final_norm(expected["final_prenorm"], norm, stored_prenorm=True)
    torch.testing.assert_close(hidden, expected["final_hidden"], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(hidden @ lm_head.T, expected["logits"], atol=2e-4, rtol=1e-4)
    wrong = apply_final_norm(expected["layer_out.5"], norm, stored_prenorm=True) @ lm_head.T
    assert (wrong - expected["logits"]).abs().max() > 1.0


def test_prenorm_flag_semantics():
    h = torch.randn(2, 3, 8)
    norm = FinalNorm("rmsnorm", 8)
    assert apply_final_norm(h, norm, stored_prenorm=None) is h
    assert apply_final_norm(h, None, stored_prenorm=False) is h
    with pytest.raises(RuntimeError, match="final-norm table"):
        apply_final_norm(h, None, stored_prenorm=True)


def test_norm_math_and_dtypes():
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    rms = FinalNorm("rmsnorm", 16, eps=1e-5, dtype=torch.bfloat16)
    with torch.no_grad():
        rms.weight.fill_(2.0)
    x32 = x.float()
    ref = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16) * 2.0
    torch.testing.assert_close(rms(x), ref)
    gemma = FinalNorm("gemma_rmsnorm", 16)  # (1 + w) with w = 0 is a plain RMS normalisation
    torch.testing.assert_close(gemma(x32), x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5))
    with pytest.raises(ValueError, match="unknown final norm type"):
        FinalNorm("layernorm", 4)


def test_weight_loading_checks_key_and_shape(tmp_path):
    norm = FinalNorm("rmsnorm", 4)
    load_final_norm_weight(norm, {K3_FINAL_NORM_KEY: torch.full((4,), 3.0)})
    assert torch.equal(norm.weight, torch.full((4,), 3.0))
    with pytest.raises(KeyError, match=K3_FINAL_NORM_KEY):
        load_final_norm_weight(norm, {"model.norm.weight": torch.ones(4)})
    with pytest.raises(ValueError, match=r"shape \[5\], expected \[4\]"):
        load_final_norm_weight(norm, {K3_FINAL_NORM_KEY: torch.ones(5)})
    from safetensors.torch import save_file

    save_file({"other": torch.ones(4)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(KeyError, match="no final-norm weight"):
        load_final_norm_weight(norm, tmp_path / "m.safetensors")
