"""Serving export (§14): exact key set, config fields, bit-exact round trip, refusals, atomic writes, sources."""

from __future__ import annotations

import json

import pytest
import torch
from draft_helpers import tiny_batch
from safetensors.torch import load_file

from lightning_eagle.draft import KimiK3Eagle3Draft, TTTCache, export_draft
from lightning_eagle.draft import export as export_module
from lightning_eagle.draft import serving_format as fmt

# Golden key/shape list for k3-tiny (N_d = 72), embedding omitted (frozen, the default).
K3_TINY_EXPORT = {
    "fc.weight": [128, 384],
    "midlayer.input_layernorm.weight": [128],
    "midlayer.hidden_norm.weight": [128],
    "midlayer.post_attention_layernorm.weight": [128],
    "midlayer.self_attn.q_a_proj.weight": [48, 256],
    "midlayer.self_attn.q_a_layernorm.weight": [48],
    "midlayer.self_attn.q_b_proj.weight": [96, 48],
    "midlayer.self_attn.kv_a_proj_with_mqa.weight": [40, 256],
    "midlayer.self_attn.kv_a_layernorm.weight": [32],
    "midlayer.self_attn.kv_b_proj.weight": [144, 32],
    "midlayer.self_attn.g_proj.weight": [80, 256],
    "midlayer.self_attn.o_proj.weight": [128, 80],
    "midlayer.mlp.gate_proj.weight": [192, 128],
    "midlayer.mlp.up_proj.weight": [192, 128],
    "midlayer.mlp.down_proj.weight": [128, 192],
    "norm.weight": [128],
    "lm_head.weight": [72, 128],
    "d2t": [72],
    "t2d": [256],
}

REQUIRED_CONFIG = [
    "architectures", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "q_lora_rank",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mla_use_nope", "mla_use_output_gate",
    "intermediate_size", "hidden_act", "activation_situ_beta", "activation_situ_linear_beta", "rms_norm_eps",
    "vocab_size", "draft_vocab_size", "target_hidden_size", "tie_word_embeddings", "torch_dtype", "bos_token_id",
    "eos_token_id", "pad_token_id", "fc_norm", "norm_output", "eagle_config", "aux_hidden_state_stream", "model_type",
]  # fmt: skip


def logits_after(draft, batch, steps=3):
    cache, h, ids = TTTCache(), draft.project(batch["aux_hidden_states"]), batch["input_ids"]
    out = []
    with torch.no_grad():
        for k in range(steps):
            if k:
                ids = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1)
            h = draft.layer(ids, h, batch["attention_mask"], cache)
            out.append(draft.logits(h))
    return out


def test_key_set_shapes_and_config(make_draft, tmp_path):
    draft = make_draft()
    out = export_draft(draft, tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    state = load_file(str(out / "model.safetensors"))
    assert {k: list(v.shape) for k, v in state.items()} == K3_TINY_EXPORT
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    config = json.loads((out / "config.json").read_text())
    assert not [k for k in REQUIRED_CONFIG if k not in config]
    assert config["architectures"] == ["Eagle3KimiK3ForCausalLM"] and config["num_hidden_layers"] == 1
    assert config["model_type"] == "kimi_k2"  # the DeepSeek-V3 config class vLLM parses MLA drafts with
    # our 0-based taps under our own key; the engines' key holds one-based ids (issue 19), top level and nested
    assert config["aux_layer_ids"] == [1, 3, 5] and config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [2, 4, 6], "use_aux_hidden_state": True}
    assert config["serving_env"] == {"VLLM_KIMI_K3_AUX_ATTN_RES_STREAM": "0"}
    assert config["aux_hidden_state_stream"] == "prefix" and config["hidden_act"] == "situ"
    assert (config["vocab_size"], config["draft_vocab_size"], config["target_hidden_size"]) == (256, 72, 128)
    assert config["torch_dtype"] == "float32" and config["tie_word_embeddings"] is False
    assert "linear_attn_config" not in config


def test_round_trip_is_bit_exact(make_draft, make_batch, tmp_path):
    draft = make_draft()
    target_embedding = draft.embed_tokens.weight.detach().clone()
    batch = make_batch(draft.config)
    out = export_draft(draft, tmp_path / "export")
    loaded = KimiK3Eagle3Draft.from_pretrained(out, target_embedding=target_embedding)
    assert loaded.config == draft.config
    for key, value in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    # The weights above are the bit-exact contract. The loaded ones live in the safetensors buffer at another byte
    # alignment, where BLAS may take another code path, so the forwards agree to fp32 noise only.
    for a, b in zip(logits_after(draft, batch), logits_after(loaded, batch)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not loaded.embed_tokens.weight.requires_grad


def test_trained_embeddings_travel_and_missing_ones_are_loud(make_draft, make_batch, tmp_path):
    draft = make_draft(freeze_embeddings=False)
    out = export_draft(draft, tmp_path / "trained")
    assert "embed_tokens.weight" in load_file(str(out / "model.safetensors"))
    loaded = KimiK3Eagle3Draft.from_pretrained(out)
    assert torch.equal(loaded.embed_tokens.weight, draft.embed_tokens.weight)
    assert loaded.embed_tokens.weight.requires_grad

    frozen = export_draft(make_draft(), tmp_path / "frozen")
    with pytest.warns(UserWarning, match="no embed_tokens.weight"):
        blind = KimiK3Eagle3Draft.from_pretrained(frozen)
    assert torch.isnan(logits_after(blind, make_batch(blind.config), 1)[0]).all()


def test_bf16_export(make_draft, tmp_path):
    draft = make_draft()
    out = export_draft(draft, tmp_path / "bf16", dtype=torch.bfloat16)
    state = load_file(str(out / "model.safetensors"))
    assert state["fc.weight"].dtype == torch.bfloat16 and state["d2t"].dtype == torch.int64
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert torch.equal(state["fc.weight"], draft.fc.weight.detach().bfloat16())
    loaded = KimiK3Eagle3Draft.from_pretrained(out, target_embedding=draft.embed_tokens.weight)
    assert loaded.fc.weight.dtype == torch.bfloat16 and loaded.t2d.dtype == torch.bool


def good_state(draft):
    state = {k: v.clone() for k, v in draft.state_dict().items()}
    state.pop("embed_tokens.weight")
    return state


@pytest.mark.parametrize(
    "corrupt, fragment",
    [
        (lambda s: s.update({"draft.fc.weight": s.pop("fc.weight")}), "trainer prefixes"),
        (lambda s: s.update({"_orig_mod.norm.weight": s.pop("norm.weight")}), "trainer prefixes"),
        (lambda s: s.update({"midlayer.self_attn.rotary_emb.inv_freq": torch.ones(4)}), "unexpected"),
        (lambda s: s.pop("midlayer.self_attn.g_proj.weight"), "missing"),
        (lambda s: s.pop("d2t"), "missing"),
        (lambda s: s.update({"lm_head.weight": torch.zeros(71, 128)}), "shape"),
        (lambda s: s.update({"d2t": s["d2t"].int()}), "dtype"),
        (lambda s: s.update({"t2d": s["t2d"].long()}), "dtype"),
        (lambda s: s.update({"norm.weight": s["norm.weight"].double()}), "share one dtype"),
        (lambda s: s["t2d"].__setitem__(torch.nonzero(s["t2d"])[0], False), "disagree"),
    ],
)
def test_refuses_bad_states(make_draft, corrupt, fragment):
    draft = make_draft()
    state = good_state(draft)
    fmt.check_state(state, draft.config, include_embeddings=False)
    corrupt(state)
    with pytest.raises(ValueError, match=fragment):
        fmt.check_state(state, draft.config, include_embeddings=False)


def test_refusal_leaves_nothing_behind(make_draft, tmp_path):
    draft = make_draft()
    state = {f"draft.{k}": v for k, v in draft.state_dict().items()}
    state["draft.extra.weight"] = torch.ones(3)
    ckpt = {"state_dict": state, **_record(draft)}
    with pytest.raises(ValueError, match="unexpected"):
        export_draft(ckpt, tmp_path / "bad")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "name", ["Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM", "LlamaForCausalLMEagle3", "MyDraft"]
)
def test_k3_draft_refuses_engine_names_and_points_to_deepseek_mla(make_draft, tmp_path, name):
    """The K3-faithful draft is only ever written as Eagle3KimiK3ForCausalLM (§14.2): an engine head would skip
    g_proj with a warning and serve another function. The message names the variant engines do serve."""
    with pytest.raises(ValueError, match=r"K3-faithful draft .*Eagle3KimiK3ForCausalLM.*architecture: deepseek_mla"):
        export_draft(make_draft(), tmp_path / "out", architecture=name)
    assert list(tmp_path.iterdir()) == []
    export_draft(make_draft(), tmp_path / "own", architecture="Eagle3KimiK3ForCausalLM")  # its own name is fine


def test_write_is_atomic(make_draft, tmp_path, monkeypatch):
    draft = make_draft()

    def crash(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(export_module, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        export_draft(draft, tmp_path / "export")
    assert list(tmp_path.iterdir()) == []  # neither the target folder nor a temporary one


def test_overwrite(make_draft, tmp_path):
    first, second = make_draft(seed=1), make_draft(seed=2)
    out = export_draft(first, tmp_path / "export")
    with pytest.raises(FileExistsError):
        export_draft(second, out)
    export_draft(second, out, overwrite=True)
    assert torch.equal(load_file(str(out / "model.safetensors"))["fc.weight"], second.fc.weight.detach())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_sources_module_checkpoint_file_and_wrappers(make_draft, tmp_path):
    draft = make_draft()
    reference = load_file(str(export_draft(draft, tmp_path / "from_module") / "model.safetensors"))

    class Module(torch.nn.Module):  # what the Lightning module looks like to the exporter
        def __init__(self):
            super().__init__()
            self.draft = draft

    from_attr = load_file(str(export_draft(Module(), tmp_path / "from_attr") / "model.safetensors"))
    state = {f"draft._orig_mod.{k}": v for k, v in draft.state_dict().items()}
    state["target.lm_head.weight"] = torch.ones(2)  # not the draft's: ignored
    ckpt = {"state_dict": state, **_record(draft)}
    torch.save(ckpt, tmp_path / "last.ckpt")
    from_file = load_file(str(export_draft(tmp_path / "last.ckpt", tmp_path / "from_file") / "model.safetensors"))
    for other in (from_attr, from_file):
        assert other.keys() == reference.keys() and all(torch.equal(other[k], reference[k]) for k in reference)
    with pytest.raises(ValueError, match="pass config="):
        export_draft({"state_dict": state}, tmp_path / "no_config")


def test_aux_ids_are_required_and_validated(make_draft, tmp_path):
    draft = make_draft()
    draft.config.aux_layer_ids = None
    with pytest.raises(ValueError, match="aux_layer_ids"):
        export_draft(draft, tmp_path / "a")
    with pytest.warns(UserWarning, match="SGLang"):  # taps layer 0
        out = export_draft(draft, tmp_path / "b", aux_layer_ids=[2, 0, 4])
    written = json.loads((out / "config.json").read_text())
    # vLLM sorts the ids: written ascending, fc's input chunks permuted to match (test_draft_engine_export.py)
    assert written["aux_layer_ids"] == [0, 2, 4] and written["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [
        1,
        3,
        5,
    ]
    with pytest.raises(ValueError, match="would be engine id 7, which vLLM never captures"):
        export_draft(draft, tmp_path / "c", aux_layer_ids=[1, 3, 6])
    with pytest.raises(ValueError, match="outside"):
        export_draft(draft, tmp_path / "d", aux_layer_ids=[1, 3, 7])


def test_source_dcp_folder(make_draft, tmp_path):
    """A DCP checkpoint folder (the ModelParallelStrategy layout) is consolidated with dcp_to_torch_save."""
    import warnings

    import torch.distributed.checkpoint as dcp

    draft = make_draft()
    state = {"state_dict": {f"draft.{k}": v for k, v in draft.state_dict().items()}, "optimizer_0": {"step": 3}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled … single process"
        dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"))
        out = export_draft(tmp_path / "ckpt", tmp_path / "export", config=draft.config)
    exported = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(exported[k], v) for k, v in draft.state_dict().items() if k != "embed_tokens.weight")


def test_legacy_k3_export_with_zero_based_engine_key_still_imports(make_draft, tmp_path):
    """Exports written before issue 19 held the 0-based ids under the engines' key and had no ``aux_layer_ids``."""
    draft = make_draft()
    out = export_draft(draft, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    for key in ("aux_layer_ids", "eagle_aux_hidden_state_layer_ids", "serving_env"):
        config.pop(key)
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 3, 5]
    (out / "config.json").write_text(json.dumps(config))
    assert KimiK3Eagle3Draft.from_pretrained(out, target_embedding=draft.embed_tokens.weight).config.aux_layer_ids == [
        1,
        3,
        5,
    ]


def test_disagreeing_aux_id_fields_are_refused(make_draft, tmp_path):
    draft = make_draft()
    out = export_draft(draft, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"\(top level\) and eagle_config.eagle_aux_hidden_state_layer_ids \[2, 4, 6\] differ"
    ):
        KimiK3Eagle3Draft.from_pretrained(out, target_embedding=draft.embed_tokens.weight)


def test_k3_export_sorts_unsorted_aux_ids_with_fc_permuted(make_draft, tmp_path):
    """Like the engine format (vLLM sorts the ids for our plugin's class too): the same function, ascending ids."""
    draft = make_draft(aux_layer_ids=[5, 1, 3], fc_norm=True)
    out = export_draft(draft, tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]
    loaded = KimiK3Eagle3Draft.from_pretrained(out, target_embedding=draft.embed_tokens.weight)
    batch = tiny_batch(draft.config)
    a5, a1, a3 = batch["aux_hidden_states"].chunk(3, dim=-1)
    reordered = {**batch, "aux_hidden_states": torch.cat([a1, a3, a5], dim=-1)}
    for ours, theirs in zip(logits_after(loaded, reordered), logits_after(draft, batch)):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["current", "prefixed", "legacy"])
def test_a_checkpoint_export_records_its_training_settings(make_draft, tmp_path, layout):
    """``ttt_steps`` / ``step_decay`` are training settings, not draft fields: a checkpoint carries them beside the
    draft config (older ones inside it, under the family-prefixed keys of the layout before) and the export writes
    them as metadata; the re-import ignores them."""
    from lightning_eagle import checkpoint_keys as keys

    draft = make_draft()
    settings = {"ttt_steps": 3, "step_decay": 0.5}
    ckpt = {"state_dict": {f"draft.{k}": v for k, v in draft.state_dict().items()}}
    if layout == "current":
        ckpt |= {keys.DRAFT_FAMILY: "eagle3", keys.DRAFT_CONFIG: draft.config.to_dict(), keys.DRAFT_TRAINING: settings}
    elif layout == "prefixed":
        ckpt |= {"eagle_draft_config": draft.config.to_dict(), "eagle_training_settings": settings}
    else:
        ckpt |= {"eagle_draft_config": {**draft.config.to_dict(), **settings}}
    out = export_draft(ckpt, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert (config["ttt_steps"], config["step_decay"]) == (3, 0.5)
    assert not [k for k in REQUIRED_CONFIG if k not in config]
    assert KimiK3Eagle3Draft.from_pretrained(out).config == draft.config


def _record(draft) -> dict:
    from lightning_eagle import checkpoint_keys as keys

    return {keys.DRAFT_FAMILY: "eagle3", keys.DRAFT_CONFIG: draft.config.to_dict()}
