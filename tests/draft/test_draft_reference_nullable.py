"""Nullable and optional ``config.json`` fields of a NeMo Automodel (reference) draft export: present with a value →
that value, present with null → null (never our default), absent → the reference's default. Each case builds a draft
with our code, writes it in the reference layout, imports it and checks the config and the logits. Also: a draft
without Q-LoRA (``q_lora_rank`` null) end to end, and our serving export keeping nullable fields null."""

from __future__ import annotations

import json

import pytest
import torch
from draft_helpers import reference_state, tiny_batch, tiny_draft
from safetensors.torch import save_file

from lightning_eagle.draft import KimiK3Eagle3Draft, export_draft
from lightning_eagle.draft.cache import TTTCache
from lightning_eagle.draft.config import FIELDS_FROM_TARGET, Eagle3DraftConfig
from lightning_eagle.draft.reference_import import config_from_reference
from lightning_eagle.draft.serving_format import config_from_json, config_to_json
from lightning_eagle.k3.presets import config_from_name

MISSING = object()  # a config.json edit that deletes the key
PUBLISHED_IDS = {"bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839}
OTHER_IDS = {"bos_token_id": 7, "eos_token_id": 8, "pad_token_id": 9}


def reference_config_json(config: Eagle3DraftConfig) -> dict:
    """The reference's ``config.json`` for a draft of ``config``: the target text config with the draft's values."""
    data = config_from_name("k3-tiny").to_dict()
    data.update({name: getattr(config, name) for name in FIELDS_FROM_TARGET})
    data.update(
        architectures=["LlamaEagle3DraftModel"],
        draft_vocab_size=config.draft_vocab_size,
        target_hidden_size=config.target_hidden_size,
        fc_norm=config.fc_norm,
        norm_output=config.norm_output,
        num_hidden_layers=config.target_num_hidden_layers,
        dtype="bfloat16",
    )
    return data


def write_reference_export(draft: KimiK3Eagle3Draft, folder, edits: dict | None = None) -> dict:
    """``draft`` in the reference layout (one shard + index, ``model.layers.0.*``), ``config.json`` edited by
    ``edits`` (a value, None for null, or MISSING). Buffers only with a compressed vocabulary, as the reference."""
    folder.mkdir()
    state = reference_state(draft)
    if not draft.config.has_vocab_compression:
        del state["d2t"], state["t2d"]
    shard = "model-00001-of-00001.safetensors"
    save_file(state, str(folder / shard))
    index = {"metadata": {}, "weight_map": dict.fromkeys(state, shard)}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    data = reference_config_json(draft.config)
    for name, value in (edits or {}).items():
        if value is MISSING:
            del data[name]
        else:
            data[name] = value
    (folder / "config.json").write_text(json.dumps(data))
    return data


@torch.no_grad()
def unroll_logits(draft: KimiK3Eagle3Draft, batch: dict, steps: int = 3) -> list[torch.Tensor]:
    """Draft logits of ``steps`` TTT steps on a fixed post-shift batch."""
    hidden, cache, ids, out = draft.project(batch["aux_hidden_states"]), TTTCache(), batch["input_ids"], []
    for k in range(steps):
        if k:
            ids = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
        hidden = draft.layer(ids, hidden, batch["attention_mask"], cache)
        out.append(draft.logits(hidden))
    return out


def assert_same_outputs(a: KimiK3Eagle3Draft, b: KimiK3Eagle3Draft) -> None:
    batch = tiny_batch(a.config)
    for step, (x, y) in enumerate(zip(unroll_logits(a, batch), unroll_logits(b, batch))):
        torch.testing.assert_close(y, x, msg=lambda m, s=step: f"step {s}: {m}")
    assert torch.equal(a.selected_token_ids, b.selected_token_ids)


# (id, source draft overrides, config.json edits, imported config fields that differ from the source's)
CASES = [
    ("q_lora_rank null", {"q_lora_rank": None}, {"q_lora_rank": None}, {}),
    ("q_lora_rank value", {}, {"q_lora_rank": 48}, {}),
    ("q_lora_rank missing", {"q_lora_rank": 1536}, {"q_lora_rank": MISSING}, {}),  # published / reference default
    ("fc_norm null", {}, {"fc_norm": None}, {}),
    ("fc_norm missing", {}, {"fc_norm": MISSING}, {}),
    ("fc_norm true", {"fc_norm": True}, {"fc_norm": True}, {}),
    ("norm_output null", {}, {"norm_output": None}, {}),
    ("norm_output missing", {}, {"norm_output": MISSING}, {}),
    ("norm_output true", {"norm_output": True}, {"norm_output": True}, {}),
    ("draft_vocab_size null", {"draft_vocab_size": None}, {"draft_vocab_size": None}, {}),  # identity map
    ("draft_vocab_size missing", {"draft_vocab_size": None}, {"draft_vocab_size": MISSING}, {}),  # not our 32000
    ("draft_vocab_size value", {}, {"draft_vocab_size": 72}, {}),
    ("target_hidden_size null", {}, {"target_hidden_size": None}, {}),  # → hidden_size
    ("target_hidden_size missing", {}, {"target_hidden_size": MISSING}, {}),
    ("target_hidden_size value", {"target_hidden_size": 64, "fc_norm": True}, {"target_hidden_size": 64}, {}),
    (
        "situ betas null",  # no cap at all: SwiGLU
        {"activation_situ_beta": None, "activation_situ_linear_beta": None},
        {"activation_situ_beta": None, "activation_situ_linear_beta": None},
        {},
    ),
    ("situ beta null", {"activation_situ_beta": None}, {"activation_situ_beta": None}, {}),
    ("situ linear beta null", {"activation_situ_linear_beta": None}, {"activation_situ_linear_beta": None}, {}),
    (
        "situ betas missing",
        {},
        {"activation_situ_beta": MISSING, "activation_situ_linear_beta": MISSING},
        {},  # 4.0 / 25.0, equal to k3-tiny's
    ),
    ("num_key_value_heads null", {}, {"num_key_value_heads": None}, {}),  # → num_attention_heads
    ("num_key_value_heads missing", {}, {"num_key_value_heads": MISSING}, {}),
    ("token ids null", {}, dict.fromkeys(PUBLISHED_IDS), dict.fromkeys(PUBLISHED_IDS)),
    ("token ids missing", {}, dict.fromkeys(PUBLISHED_IDS, MISSING), PUBLISHED_IDS),
    ("token ids value", {}, OTHER_IDS, OTHER_IDS),
    ("num_hidden_layers null", {}, {"num_hidden_layers": None}, {"target_num_hidden_layers": None}),
    ("num_hidden_layers missing", {}, {"num_hidden_layers": MISSING}, {"target_num_hidden_layers": None}),
    ("num_aux_hidden_states value", {}, {"num_aux_hidden_states": 3}, {}),
    ("mla_use_output_gate null", {"mla_use_output_gate": False}, {"mla_use_output_gate": None}, {}),  # flag: off
    (
        "everything nullable at once",
        {
            "q_lora_rank": None,
            "activation_situ_beta": None,
            "activation_situ_linear_beta": None,
            "draft_vocab_size": None,
            "fc_norm": True,
            "norm_output": True,
        },
        {"q_lora_rank": None, "draft_vocab_size": None, "target_hidden_size": None, "bos_token_id": None},
        {"bos_token_id": None},
    ),
]


@pytest.mark.parametrize("overrides, edits, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_reference_optional_fields_round_trip(overrides, edits, expected, tmp_path):
    source = tiny_draft(seed=3, **overrides)
    data = write_reference_export(source, tmp_path / "ref", edits)
    for name, value in edits.items():  # the export really says what the case claims
        assert (name not in data) if value is MISSING else (data[name] == value)
    loaded = KimiK3Eagle3Draft.from_pretrained(tmp_path / "ref")
    want = source.config.to_dict() | {"aux_layer_ids": None, "aux_stream": None} | expected
    assert loaded.config.to_dict() == want
    assert_same_outputs(source, loaded)


@pytest.mark.parametrize("name", ["hidden_size", "rms_norm_eps", "vocab_size", "num_aux_hidden_states"])
def test_null_without_meaning_is_refused(name, tmp_path):
    """Null in a field that cannot be null must not silently become our default (a different draft)."""
    write_reference_export(tiny_draft(), tmp_path / "ref", {name: None})
    with pytest.raises(ValueError, match=f"{name} is null"):
        KimiK3Eagle3Draft.from_pretrained(tmp_path / "ref")


def test_reference_config_nested_under_text_config():
    data = reference_config_json(tiny_draft(q_lora_rank=None).config)
    assert config_from_reference({"text_config": data}).q_lora_rank is None


def test_no_q_lora_draft_end_to_end(tmp_path):
    """``q_lora_rank`` null: a plain ``q_proj`` trains (finite gradients), imports from the reference layout and
    re-exports to ours with ``"q_lora_rank": null``, with identical outputs throughout."""
    from lightning_eagle.training import ttt_loss

    source = tiny_draft(seed=4, q_lora_rank=None)
    attn = source.midlayer.self_attn
    assert not hasattr(attn, "q_a_proj") and tuple(attn.q_proj.weight.shape) == (4 * 24, 256)
    batch = tiny_batch(source.config)
    out = ttt_loss(source, **batch, ttt_steps=3)
    out.loss.backward()
    assert attn.q_proj.weight.grad is not None and bool(attn.q_proj.weight.grad.abs().sum() > 0)
    assert all(bool(p.grad.isfinite().all()) for p in source.parameters() if p.grad is not None)
    source.zero_grad(set_to_none=True)

    write_reference_export(source, tmp_path / "ref", {"q_lora_rank": None})
    imported = KimiK3Eagle3Draft.from_pretrained(tmp_path / "ref")
    assert imported.config.q_lora_rank is None
    assert_same_outputs(source, imported)
    ours = export_draft(imported, tmp_path / "ours", aux_layer_ids=[1, 3, 5], aux_stream="prefix")
    assert json.loads((ours / "config.json").read_text())["q_lora_rank"] is None
    again = KimiK3Eagle3Draft.from_pretrained(ours, target_embedding=source.embed_tokens.weight)
    assert again.config.q_lora_rank is None
    assert_same_outputs(source, again)


NULLABLE_SERVING = {
    "q_lora_rank": None,
    "activation_situ_beta": None,
    "activation_situ_linear_beta": None,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
    "target_num_hidden_layers": None,
}


def test_serving_config_keeps_nullable_fields_null():
    config = tiny_draft(**NULLABLE_SERVING).config
    data = json.loads(json.dumps(config_to_json(config, torch.float32)))  # through real JSON
    for name in NULLABLE_SERVING:
        assert name in data and data[name] is None, name
    assert config_from_json(data).to_dict() == config.to_dict()
    # A field that is absent (older or hand-written file) takes our default; null stays null.
    del data["q_lora_rank"]
    assert config_from_json(data).q_lora_rank == Eagle3DraftConfig.q_lora_rank == 1536


def test_serving_export_round_trips_nullable_fields(tmp_path):
    source = tiny_draft(seed=5, **NULLABLE_SERVING)
    folder = export_draft(source, tmp_path / "ours", include_embeddings=True)
    data = json.loads((folder / "config.json").read_text())
    assert all(data[name] is None for name in NULLABLE_SERVING)
    loaded = KimiK3Eagle3Draft.from_pretrained(folder)
    assert loaded.config.to_dict() == source.config.to_dict()
    assert_same_outputs(source, loaded)
