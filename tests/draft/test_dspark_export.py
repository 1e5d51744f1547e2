"""The DSpark export: vLLM's config fields, exact round trip, the serving command, refusals, atomic overwrite."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lightning_eagle.draft.dspark import DSparkDrafter
from lightning_eagle.draft.dspark_config import dspark_config_from_preset
from lightning_eagle.draft.dspark_export import (
    dspark_config_from_json,
    dspark_serving_command,
    export_dspark_draft,
    load_dspark_export,
)

YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.7, "mscale_all_dim": 1.0}


def drafter(**overrides) -> DSparkDrafter:
    torch.manual_seed(0)
    model = DSparkDrafter(dspark_config_from_preset("k3-tiny", **overrides))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()  # every tensor distinct from its init, so a dropped or swapped one shows
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_exact(tmp_path, dtype):
    model = drafter(rope_scaling=YARN, aux_stream="mixed")
    folder = export_dspark_draft(model, tmp_path / "served", dtype=dtype)
    weights = load_file(str(folder / "model.safetensors"))
    assert set(weights) == set(model.state_dict())
    for name, tensor in model.state_dict().items():
        want = torch.float32 if name.startswith("confidence_head.") else dtype
        assert weights[name].dtype == want
        assert torch.equal(weights[name], tensor.to(want)), name
    loaded = load_dspark_export(folder)
    assert loaded.config == model.config
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, weights[name].float()), name


def test_config_json_holds_what_vllm_reads(tmp_path):
    model = drafter(rope_scaling=YARN)
    data = json.loads((export_dspark_draft(model, tmp_path / "served") / "config.json").read_text())
    c = model.config
    assert data["architectures"] == ["K3DSparkModel"] and data["model_type"] == "k3_dspark"
    assert data["target_layer_ids"] == c.aux_layer_ids and data["num_target_layers"] == len(c.aux_layer_ids)
    assert data["draft_vocab_size"] == data["vocab_size"] == c.vocab_size
    assert data["q_lora_rank"] == c.q_lora_rank and data["mask_token_id"] == c.mask_token_id
    assert data["num_key_value_heads"] == data["num_attention_heads"] == c.num_attention_heads
    assert data["rope_parameters"]["rope_type"] == "yarn"
    assert data["rope_parameters"]["rope_theta"] == c.rope_theta
    assert data["rope_parameters"]["factor"] == YARN["factor"]
    assert data["enable_confidence_head"] is data["confidence_head_with_markov"] is True
    assert data["sample_from_anchor"] is True
    assert data["serving_env"] == {"VLLM_KIMI_K3_AUX_ATTN_RES_STREAM": "0"}
    for refused in ("mla_use_nope", "mla_use_output_gate", "mla_use_qk_norm", "dspark_bonus_anchor"):
        assert not data.get(refused)
    default_rope = dspark_config_from_json({**data, "rope_parameters": {"rope_type": "default", "rope_theta": 9e4}})
    assert default_rope.rope_scaling is None and default_rope.rope_theta == 9e4


def test_every_config_field_survives_config_json():
    """The export writes every DSparkDraftConfig field (one list: the dataclass's): each one that has a default is
    set off it here, so a field the writer or the reader dropped would come back as its default."""
    import dataclasses

    from lightning_eagle.draft.dspark_config import DSparkDraftConfig
    from lightning_eagle.draft.dspark_export import dspark_config_json

    off_default = {"markov_rank": 8, "enable_confidence_head": False, "rms_norm_eps": 1e-6, "rope_theta": 9e4,
                   "rope_scaling": YARN, "max_position_embeddings": 8192, "target_num_hidden_layers": 7,
                   "aux_stream": "mixed", "initializer_range": 0.01}  # fmt: skip
    config = dspark_config_from_preset("k3-tiny", **off_default)
    defaults = {f.name: f.default for f in dataclasses.fields(DSparkDraftConfig)}
    changed = {name for name in defaults if getattr(config, name) != defaults[name]}
    assert changed == set(defaults) - {"hidden_act"}  # silu is the only value vLLM's KimiMLP takes
    assert dspark_config_from_json(dspark_config_json(config, torch.float32)) == config


def test_serving_command(tmp_path):
    model = drafter(aux_stream="mixed")
    folder = export_dspark_draft(model, tmp_path / "served")
    line = dspark_serving_command(json.loads((folder / "config.json").read_text()), str(folder), target="/m/K3")
    assert line.startswith("VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1 vllm serve /m/K3 --speculative-config '")
    spec = json.loads(line.split("--speculative-config '")[1].rstrip("'"))
    assert spec == {
        "method": "dspark",
        "model": str(folder),
        "num_speculative_tokens": model.config.block_size,
        "draft_sample_method": "greedy",
        "rejection_sample_method": "standard",
    }


def test_refusals_and_overwrite(tmp_path):
    model = drafter()
    folder = export_dspark_draft(model, tmp_path / "served")
    with pytest.raises(FileExistsError, match="exists; pass --overwrite"):
        export_dspark_draft(model, folder)
    export_dspark_draft(drafter(block_size=3), folder, overwrite=True)
    assert json.loads((folder / "config.json").read_text())["block_size"] == 3
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"it holds other files \(notes.txt\)"):
        export_dspark_draft(model, tmp_path / "mine", overwrite=True)
    with pytest.raises(TypeError, match="export_dspark_draft takes a DSparkDrafter"):
        export_dspark_draft(torch.nn.Linear(2, 2), tmp_path / "other")
    data = json.loads((folder / "config.json").read_text())
    with pytest.raises(ValueError, match="not a DSpark export"):
        dspark_config_from_json({**data, "architectures": ["Eagle3DeepseekV2ForCausalLM"]})
    weights = load_file(str(folder / "model.safetensors"))
    del weights["markov_head.markov_w2.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['markov_head.markov_w2.weight'\]"):
        load_dspark_export(folder)


def test_a_checkpoint_draft_is_read_as_strictly_as_an_export():
    """Export and checkpoint readers share one strict load: the same tensors back, a missing or reshaped one named."""
    from lightning_eagle import checkpoint_keys as keys
    from lightning_eagle.draft.dspark_export import dspark_drafter_from_checkpoint

    model = drafter()
    state = {f"draft.{k}": v for k, v in model.state_dict().items()}
    checkpoint = {keys.DRAFT_FAMILY: "dspark", keys.DRAFT_CONFIG: model.config.to_dict(),
                  "state_dict": {**state, "teacher.x": 0}}  # fmt: skip
    loaded = dspark_drafter_from_checkpoint(checkpoint)
    assert loaded.config == model.config
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    del checkpoint["state_dict"]["draft.markov_head.markov_w2.weight"]
    with pytest.raises(ValueError, match=r"checkpoint's DSpark draft: .*missing \['markov_head.markov_w2.weight'\]"):
        dspark_drafter_from_checkpoint(checkpoint)
    checkpoint["state_dict"] = {**state, "draft.context_proj.weight": state["draft.context_proj.weight"][:, :-1]}
    with pytest.raises(ValueError, match=r"wrong shapes \[\('context_proj.weight'"):
        dspark_drafter_from_checkpoint(checkpoint)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"mla_use_nope": True}, r"sets \['mla_use_nope'\]: vLLM's MLA DSpark does not support them"),
        ({"dspark_bonus_anchor": True}, r"sets \['dspark_bonus_anchor'\]"),
        ({"draft_vocab_size": 256}, "draft_vocab_size 256 != vocab_size 512"),
        ({"num_target_layers": 2}, r"num_target_layers 2 != len\(target_layer_ids\) 3"),
        ({"q_lora_rank": None}, "q_lora_rank is required"),
        ({"sample_from_anchor": False}, "sample_from_anchor must be true"),
        ({"target_layer_ids": [], "num_target_layers": 0}, "expected at least one id: vLLM"),
    ],
)
def test_reader_refuses_what_vllm_refuses(tmp_path, changes, message):
    data = json.loads((export_dspark_draft(drafter(), tmp_path / "served") / "config.json").read_text())
    with pytest.raises(ValueError, match=message):
        dspark_config_from_json({**data, **changes})
