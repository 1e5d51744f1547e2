"""Checkpoint loading in the released layout (spec k3_target §4, §8.8)."""

import json

import pytest
import torch
from k3_helpers import snap_experts_to_mxfp4, tiny_model
from safetensors.torch import load_file, save_file

from lightning_eagle import KimiK3ForCausalLM
from lightning_eagle.k3.loader import CheckpointError, SafetensorsCheckpoint
from lightning_eagle.k3.mxfp4 import decode_mxfp4
from lightning_eagle.k3.writer import save_k3_checkpoint


@pytest.fixture(scope="module")
def source():
    return snap_experts_to_mxfp4(tiny_model(seed=3))


@pytest.fixture(scope="module")
def ckpt_dir(source, tmp_path_factory):
    return save_k3_checkpoint(source, tmp_path_factory.mktemp("ck") / "k3", num_shards=3)


def _logits(model, seed=0):
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(seed))
    return model(ids).logits


def _assert_same_model(loaded, source):
    """The round-trip contract is bit-exact weights; the forwards then only agree to fp32 noise, because loaded
    tensors may live in the safetensors buffer at another byte alignment (BLAS may take another code path)."""
    expected = source.state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, expected[key]), key
    torch.testing.assert_close(_logits(loaded), _logits(source), rtol=1e-5, atol=1e-6)


def test_mxfp4_decode_hand_built_bytes():
    packed = torch.zeros(2, 16, dtype=torch.uint8)
    packed[0, 0] = 0x21  # element 0 = code 1 (0.5, low nibble), element 1 = code 2 (1.0, high nibble)
    packed[0, 1] = 0x8F  # element 2 = code 15 (-6), element 3 = code 8 (-0)
    packed[1, 15] = 0x7A  # element 30 = code 10 (-1), element 31 = code 7 (6)
    scale = torch.tensor([[128], [125]], dtype=torch.uint8)  # 2^1 and 2^-2
    out = decode_mxfp4(packed, scale)
    assert out[0, :4].tolist() == [1.0, 2.0, -12.0, -0.0] and out[0, 4:].abs().sum() == 0
    assert out[1, 30:].tolist() == [-0.25, 1.5] and out[1, :30].abs().sum() == 0
    dest = torch.zeros(32, 2).t()  # a non-contiguous destination view
    assert not dest.is_contiguous()
    decode_mxfp4(packed, scale, out=dest)
    assert torch.equal(dest, out)  # exact: decoding is a table lookup times a power of two
    with pytest.raises(ValueError, match="scale byte 255"):
        decode_mxfp4(packed, torch.full((2, 1), 255, dtype=torch.uint8))
    with pytest.raises(ValueError, match="not divisible by the group size 32"):
        decode_mxfp4(torch.zeros(1, 8, dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.uint8))


@pytest.mark.parametrize("mxfp4, shards, vlm", [(True, 3, True), (False, 1, True), (True, 1, False)])
def test_round_trip_layouts(source, tmp_path, mxfp4, shards, vlm):
    path = save_k3_checkpoint(source, tmp_path / "k3", mxfp4=mxfp4, num_shards=shards, vlm_wrapper=vlm)
    loaded = KimiK3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    _assert_same_model(loaded, source)
    assert not any(p.requires_grad for p in loaded.parameters()) and not loaded.training


def test_checkpoint_layout_details(ckpt_dir, source):
    index = json.loads((ckpt_dir / "model.safetensors.index.json").read_text())
    state = {}
    for shard in set(index["weight_map"].values()):
        state.update(load_file(str(ckpt_dir / shard)))
    a_log = state["language_model.model.layers.0.self_attn.A_log"]
    assert a_log.shape == (128,) and a_log[3:].abs().sum() == 0
    w1 = decode_mxfp4(
        state["language_model.model.layers.1.block_sparse_moe.experts.2.w1.weight_packed"],
        state["language_model.model.layers.1.block_sparse_moe.experts.2.w1.weight_scale"],
    )
    w3 = decode_mxfp4(
        state["language_model.model.layers.1.block_sparse_moe.experts.2.w3.weight_packed"],
        state["language_model.model.layers.1.block_sparse_moe.experts.2.w3.weight_scale"],
    )
    gate_up = source.model.layers[1].block_sparse_moe.experts.gate_up_proj[2]
    assert torch.equal(gate_up[:, :32], w1.t()) and torch.equal(gate_up[:, 32:], w3.t())  # gate half first


def test_fp32_islands_and_dtype(ckpt_dir):
    model = KimiK3ForCausalLM.from_pretrained(ckpt_dir, dtype=torch.bfloat16)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    for name in (
        "model.layers.0.self_attn.A_log",
        "model.layers.0.self_attn.dt_bias",
        "model.layers.0.self_attn.k_conv1d.weight",
        "model.layers.0.self_attn.o_norm.weight",
        "model.layers.2.block_sparse_moe.gate.e_score_correction_bias",
    ):
        assert dtypes[name] == torch.float32, name
    assert dtypes["model.layers.1.block_sparse_moe.experts.down_proj"] == torch.bfloat16
    assert dtypes["lm_head.weight"] == torch.bfloat16


def test_expert_range_reads_only_local_expert_bytes(ckpt_dir, source, monkeypatch):
    read = []
    original = SafetensorsCheckpoint.get
    monkeypatch.setattr(SafetensorsCheckpoint, "get", lambda self, key: read.append(key) or original(self, key))
    model = KimiK3ForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32, expert_range=(4, 4))
    experts_read = {int(k.split(".experts.")[1].split(".")[0]) for k in read if ".experts." in k}
    assert experts_read == {4, 5, 6, 7}
    local = model.model.layers[3].block_sparse_moe.experts
    assert local.gate_up_proj.shape[0] == 4
    assert torch.equal(local.down_proj, source.model.layers[3].block_sparse_moe.experts.down_proj[4:])


def test_golden_checkpoint_skips_vision_and_strips_prefix(golden_dir):
    model = KimiK3ForCausalLM.from_pretrained(golden_dir / "target", dtype=torch.float32)
    assert model.config.num_hidden_layers == 8
    assert not any("vision" in n or "mm_projector" in n for n, _ in model.named_parameters())
    assert model.model.layers[0].self_attn.A_log.shape == (4,)


def _rewrite(ckpt_dir, tmp_path, edit):
    out = tmp_path / "edited"
    out.mkdir()
    (out / "config.json").write_text((ckpt_dir / "config.json").read_text())
    state = {}
    for shard in sorted(ckpt_dir.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    edit(state)
    save_file(state, str(out / "model.safetensors"))
    return out


LAYER1 = "language_model.model.layers.1."


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (lambda s: s.pop(LAYER1 + "input_layernorm.weight"), "missing 1 key(s): " + LAYER1 + "input_layernorm.weight"),
        (
            lambda s: s.pop(LAYER1 + "block_sparse_moe.experts.3.w2.weight_scale"),
            LAYER1 + "block_sparse_moe.experts.3.w2.weight (or .weight_packed + .weight_scale)",
        ),
        (
            lambda s: s.__setitem__(LAYER1 + "self_attn.extra.weight", torch.zeros(2)),
            "unexpected 1 key(s): " + LAYER1 + "self_attn.extra.weight",
        ),
        (
            lambda s: s.__setitem__(LAYER1 + "block_sparse_moe.experts.8.w1.weight", torch.zeros(32, 96)),
            "unexpected 1 key(s): " + LAYER1 + "block_sparse_moe.experts.8.w1.weight",
        ),
        (
            lambda s: s.__setitem__("language_model.lm_head.weight", torch.zeros(255, 128)),
            "'language_model.lm_head.weight' in model.safetensors: expected (256, 128), got (255, 128)",
        ),
        (
            lambda s: s.__setitem__(
                LAYER1 + "block_sparse_moe.experts.0.w2.weight_packed", torch.zeros(96, 8, dtype=torch.uint8)
            ),
            "expected packed (96, 16)",
        ),
        (lambda s: s.__setitem__(LAYER1 + "self_attn.A_log", torch.ones(128)), "A_log padding beyond 3 heads"),
        (lambda s: s.__setitem__(LAYER1 + "self_attn.dt_bias", torch.full((96,), float("nan"))), "NaN or Inf"),
    ],
)
def test_loader_errors_name_keys_and_file(ckpt_dir, tmp_path, edit, fragment):
    path = _rewrite(ckpt_dir, tmp_path, edit)
    with pytest.raises(CheckpointError) as err:
        KimiK3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert fragment in str(err.value)


def test_corrupt_and_inconsistent_files(ckpt_dir, tmp_path):
    bad = tmp_path / "corrupt"
    bad.mkdir()
    (bad / "config.json").write_text((ckpt_dir / "config.json").read_text())
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CheckpointError, match="model.safetensors: cannot read safetensors file"):
        KimiK3ForCausalLM.from_pretrained(bad)
    (bad / "config.json").write_text("{")
    with pytest.raises(CheckpointError, match="config.json: invalid JSON"):
        KimiK3ForCausalLM.from_pretrained(bad)
    (bad / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(CheckpointError, match="not a Kimi K3 model"):
        KimiK3ForCausalLM.from_pretrained(bad)
    idx = tmp_path / "idx"
    idx.mkdir()
    (idx / "config.json").write_text((ckpt_dir / "config.json").read_text())
    (idx / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(CheckpointError, match="lists shard gone.safetensors, which does not exist"):
        KimiK3ForCausalLM.from_pretrained(idx)
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        KimiK3ForCausalLM.from_pretrained(tmp_path / "nowhere")


def test_mxfp4_expert_storage_keeps_bytes_packed(ckpt_dir, source, tmp_path):
    packed = KimiK3ForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32, expert_storage="mxfp4")
    experts = packed.model.layers[2].block_sparse_moe.experts
    assert experts.gate_up_packed.dtype == torch.uint8 and not hasattr(experts, "gate_up_proj")
    # same decoded values; only the matmul operand layout differs (transposed view), hence fp32-noise tolerance
    torch.testing.assert_close(_logits(packed), _logits(source), rtol=1e-5, atol=1e-5)
    gate_up, down = experts.weights(1, torch.float32)  # decoded on the fly == the dequantised stack
    source_experts = source.model.layers[2].block_sparse_moe.experts
    assert torch.equal(gate_up, source_experts.gate_up_proj[1]) and torch.equal(down, source_experts.down_proj[1])
    half = KimiK3ForCausalLM.from_pretrained(
        ckpt_dir, dtype=torch.bfloat16, expert_storage="mxfp4", expert_range=(4, 4)
    )
    assert half.model.layers[1].block_sparse_moe.experts.down_packed.shape == (4, 96, 16)
    rewritten = save_k3_checkpoint(packed, tmp_path / "again")  # packed bytes are written back unchanged
    _assert_same_model(KimiK3ForCausalLM.from_pretrained(rewritten, dtype=torch.float32), source)


def test_mxfp4_storage_refuses_plain_experts(source, tmp_path):
    plain = save_k3_checkpoint(source, tmp_path / "plain", mxfp4=False)
    with pytest.raises(CheckpointError, match="expert_storage='mxfp4' needs MXFP4 experts"):
        KimiK3ForCausalLM.from_pretrained(plain, expert_storage="mxfp4")


def test_quickstart_name_loads_the_bundled_target():
    model = KimiK3ForCausalLM.from_pretrained("quickstart", dtype=torch.float32)
    assert model.config.vocab_size == 512 and not any(p.requires_grad for p in model.parameters())
