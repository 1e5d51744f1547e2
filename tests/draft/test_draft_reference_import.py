"""Importing NeMo Automodel's K3 draft export: key mapping, sharded folders, the frequency-order vocabulary sorted to
ascending (lm_head rows and d2t together), the identity case without buffers, refusals, and the golden export."""

from __future__ import annotations

import json

import pytest
import torch
from draft_helpers import reference_state
from safetensors.torch import load_file, save_file

from lightning_eagle.draft import KimiK3Eagle3Draft, export_draft
from lightning_eagle.draft.reference_import import reference_vocab_permutation
from lightning_eagle.k3.presets import config_from_name


def write_reference_export(draft, folder, order=None, with_buffers=True):
    """Write ``draft`` the way the reference's checkpointer does (two shards + index), vocabulary in ``order``."""
    folder.mkdir()
    state = reference_state(draft)
    if order is not None:
        selected = draft.selected_token_ids[order]
        state["lm_head.weight"] = state["lm_head.weight"][order].contiguous()
        state["d2t"] = selected - torch.arange(selected.numel())
    if not with_buffers:
        del state["d2t"], state["t2d"]
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, names in shards.items():
        save_file({k: state[k] for k in names}, str(folder / name))
    index = {"metadata": {}, "weight_map": {k: n for n, names in shards.items() for k in names}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    config = config_from_name("k3-tiny").to_dict()
    config.update(
        architectures=["LlamaEagle3DraftModel"],
        draft_vocab_size=draft.config.draft_vocab_size,
        target_hidden_size=128,
        fc_norm=draft.config.fc_norm,
        norm_output=False,
        dtype="bfloat16",  # the reference writes the target's dtype, not the tensors'
    )
    (folder / "config.json").write_text(json.dumps(config))
    return state


def test_frequency_order_is_sorted_on_import(make_draft, make_batch, tmp_path):
    draft = make_draft(fc_norm=True)
    order = torch.randperm(72, generator=torch.Generator().manual_seed(5))
    ref_state = write_reference_export(draft, tmp_path / "ref", order=order)
    assert bool((ref_state["d2t"] < 0).any())  # frequency order really is non-ascending here
    loaded = KimiK3Eagle3Draft.from_pretrained(tmp_path / "ref")
    for key, value in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert loaded.config.aux_layer_ids is None and loaded.config.aux_stream is None
    assert loaded.config.fc_norm and loaded.config.target_num_hidden_layers == 6
    # target-id space: the reference-order logits, scattered by the reference's own map, equal ours
    batch = make_batch(draft.config)
    with torch.no_grad():
        h = loaded.project(batch["aux_hidden_states"])
        ours = loaded.logits(h)
        theirs = torch.nn.functional.linear(loaded.norm(h), ref_state["lm_head.weight"])
    ref_selected = torch.arange(72) + ref_state["d2t"]
    full_ours = torch.full((*ours.shape[:-1], 256), float("nan")).index_copy(-1, loaded.selected_token_ids, ours)
    full_theirs = torch.full((*ours.shape[:-1], 256), float("nan")).index_copy(-1, ref_selected, theirs)
    # Their lm_head rows are permuted, so each logit comes from another GEMM column (and another weight buffer):
    # fp32 tolerance on the values, exact NaN positions (= the same selected target ids).
    torch.testing.assert_close(full_ours, full_theirs, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_reexport_needs_aux_ids(make_draft, tmp_path):
    draft = make_draft()
    write_reference_export(draft, tmp_path / "ref")
    loaded = KimiK3Eagle3Draft.from_pretrained(tmp_path / "ref")
    with pytest.raises(ValueError, match="aux_layer_ids"):
        export_draft(loaded, tmp_path / "ours")
    out = export_draft(loaded, tmp_path / "ours", aux_layer_ids=[1, 3, 5], aux_stream="prefix")
    again = KimiK3Eagle3Draft.from_pretrained(out, target_embedding=loaded.embed_tokens.weight)
    assert again.config.aux_layer_ids == [1, 3, 5]
    assert torch.equal(again.lm_head.weight, loaded.lm_head.weight)


def test_full_vocabulary_reference_has_no_buffers(make_draft, tmp_path):
    draft = make_draft(draft_vocab_size=None)
    write_reference_export(draft, tmp_path / "ref", with_buffers=False)
    loaded = KimiK3Eagle3Draft.from_pretrained(tmp_path / "ref")
    assert loaded.config.draft_vocab_size == 256
    assert bool(loaded.t2d.all()) and not bool(loaded.d2t.any())


def test_invalid_reference_maps_are_refused():
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[1, 4, 7]] = True
    assert reference_vocab_permutation(torch.tensor([7, 0, 2]), t2d).tolist() == [1, 2, 0]
    with pytest.raises(ValueError, match="same target id"):
        reference_vocab_permutation(torch.tensor([4, 3, 5]), t2d)  # 4, 4, 7
    with pytest.raises(ValueError, match="disagree"):
        reference_vocab_permutation(torch.tensor([1, 3, 6]), t2d)  # 1, 4, 8
    with pytest.raises(ValueError, match="outside"):
        reference_vocab_permutation(torch.tensor([1, 3, 9]), t2d)


def test_non_k3_reference_draft_is_refused(make_draft, tmp_path):
    draft = make_draft()
    state = write_reference_export(draft, tmp_path / "ref")
    extra = {"model.layers.0.self_attn.k_proj.weight": torch.zeros(4, 4)}  # a Llama-style draft key
    save_file(extra, str(tmp_path / "ref" / "model-extra.safetensors"))
    index = json.loads((tmp_path / "ref" / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.self_attn.k_proj.weight"] = "model-extra.safetensors"
    (tmp_path / "ref" / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "lm_head.weight" in state
    with pytest.raises(ValueError, match="unexpected"):
        KimiK3Eagle3Draft.from_pretrained(tmp_path / "ref")


def test_golden_reference_export_loads(golden_draft_dir):
    export = golden_draft_dir / "export"
    raw = load_file(str(export / "model-00001-of-00001.safetensors"))
    draft = KimiK3Eagle3Draft.from_pretrained(export)
    c = draft.config
    assert (c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank) == (64, 4, 32, 16)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.intermediate_size) == (16, 8, 16, 128)
    assert (c.vocab_size, c.draft_vocab_size, c.rms_norm_eps) == (512, 256, 1e-5)
    assert c.aux_layer_ids is None and c.aux_stream is None
    assert not bool((raw["d2t"][1:] >= raw["d2t"][:-1]).all())  # the golden map is in frequency order
    perm = reference_vocab_permutation(raw["d2t"], raw["t2d"])
    assert torch.equal(draft.lm_head.weight, raw["lm_head.weight"][perm])
    assert torch.equal(draft.selected_token_ids, torch.nonzero(raw["t2d"]).flatten())
    assert torch.equal(draft.t2d, raw["t2d"]) and bool((draft.d2t >= 0).all())
    assert torch.equal(draft.embed_tokens.weight, raw["model.embed_tokens.weight"])
    assert torch.equal(draft.midlayer.self_attn.g_proj.weight, raw["model.layers.0.self_attn.g_proj.weight"])
    assert draft.fc.weight.dtype == torch.float32  # tensors keep their stored dtype (the config says bfloat16)
