"""The engine export of a deepseek_mla draft (``Eagle3DeepseekV2ForCausalLM``), proven without a GPU:

(a) SGLang's weight-name mapping, reproduced from the pinned loader source, maps our export onto its parameter set
    with no dropped, missing or extra name and matching shapes (vLLM's own loader, forward and engine run on our export
    in ``tests/engine/test_vllm_engine.py``);
(b) a plain-torch re-implementation of the engine draft's forward (its fused projections after the loader's fusion,
    interleaved DeepSeek-YaRN rotary, softmax scale with mscale, fused-add RMSNorm order, d2t offsets), loaded from
    the export file, equals our draft's TTT steps at fp32 tolerance — prefix pass and chain steps, which also checks
    the position convention t + k against the engines' "positions += 1 per draft step";
plus the golden key list, config fields, bf16 default, refusals, atomic writes and the re-import round trip.

Pinned sources (read, rules re-written here):

* SGLang  sgl-project/sglang@40449c10941dc84131efd240ba3d162177a811f7 ``python/sglang/srt/models/kimi_k25_eagle3.py``
  (``Eagle3DeepseekV2ForCausalLM.load_weights``, ``Eagle3MLAModel``, ``Eagle3MLADecoderLayer``);
* vLLM    vllm-project/vllm@0c838b5a3941176792f2f9b3ac319025fb38dd85 ``vllm/model_executor/models/deepseek_eagle3.py``
  (``Eagle3DeepseekV2ForCausalLM.load_weights`` → ``DeepseekV2Eagle3Model.load_weights``) and
  ``vllm/model_executor/models/deepseek_v2.py`` (``DeepseekV2MLAAttention``: ``fused_qkv_a_proj``, mscale²);
* rotary: SGLang ``python/sglang/srt/layers/rotary_embedding/{rope_variant,yarn,utils}.py``
  (``DeepseekScalingRotaryEmbedding``, ``apply_rotary_emb`` with ``is_neox_style=False``).
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import torch.nn.functional as F
from draft_helpers import tiny_batch, tiny_draft
from safetensors.torch import load_file, save_file

from lightning_eagle.draft import KimiK3Eagle3Draft, TTTCache, export_draft
from lightning_eagle.draft import serving_format as fmt
from lightning_eagle.training.shift import shift_left

YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "mscale": 0.7, "mscale_all_dim": 1.0}

# Golden key/shape list of the k3-tiny deepseek_mla export (N_d = 72), embedding omitted (frozen, the default).
TINY_ENGINE_EXPORT = {
    "fc.weight": [128, 384],
    "layers.0.input_layernorm.weight": [128],
    "layers.0.hidden_norm.weight": [128],
    "layers.0.post_attention_layernorm.weight": [128],
    "layers.0.self_attn.q_a_proj.weight": [48, 256],
    "layers.0.self_attn.q_a_layernorm.weight": [48],
    "layers.0.self_attn.q_b_proj.weight": [96, 48],
    "layers.0.self_attn.kv_a_proj_with_mqa.weight": [40, 256],
    "layers.0.self_attn.kv_a_layernorm.weight": [32],
    "layers.0.self_attn.kv_b_proj.weight": [144, 32],
    "layers.0.self_attn.o_proj.weight": [128, 80],
    "layers.0.mlp.gate_proj.weight": [192, 128],
    "layers.0.mlp.up_proj.weight": [192, 128],
    "layers.0.mlp.down_proj.weight": [128, 192],
    "norm.weight": [128],
    "lm_head.weight": [72, 128],
    "d2t": [72],
    "t2d": [256],
}


def mla_draft(seed=0, **overrides):
    return tiny_draft(seed=seed, architecture="deepseek_mla", **overrides)


def export(draft, folder, **kwargs):
    export_draft(draft, folder, **kwargs)
    return json.loads((folder / "config.json").read_text()), load_file(folder / "model.safetensors")


# ---- format ------------------------------------------------------------------------------------------------------
def test_golden_keys_config_and_bf16_default(tmp_path):
    draft = mla_draft(rope_scaling=YARN)
    config, weights = export(draft, tmp_path / "out")
    assert {k: list(v.shape) for k, v in weights.items()} == TINY_ENGINE_EXPORT
    assert {str(v.dtype) for k, v in weights.items() if k not in ("d2t", "t2d")} == {"torch.bfloat16"}
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    # kimi_k2, not deepseek_v3: vLLM rewrites a deepseek_v3 draft into a DeepSeek MTP config (issue 19)
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["model_type"] == "kimi_k2"
    assert config["num_hidden_layers"] == 1 and config["hidden_act"] == "silu" and config["torch_dtype"] == "bfloat16"
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [2, 4, 6], "use_aux_hidden_state": True}
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]  # vLLM's V2 model runner reads only this one
    assert config["aux_layer_ids"] == [1, 3, 5] and config["serving_env"] == {"VLLM_KIMI_K3_AUX_ATTN_RES_STREAM": "0"}
    for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "hidden_size",
                 "num_attention_heads", "num_key_value_heads", "intermediate_size", "draft_vocab_size", "vocab_size",
                 "target_hidden_size", "rms_norm_eps", "rope_theta", "fc_norm", "norm_output"):  # fmt: skip
        assert config[name] == getattr(draft.config, name), name
    assert config["rope_scaling"] == {**draft.config.rope_scaling, "rope_theta": 10000.0}
    assert config["max_position_embeddings"] == 256 and config["tie_word_embeddings"] is False
    assert not any(name.startswith(("mla_", "activation_situ")) for name in config)  # K3-only fields stay out
    assert fmt.config_from_json(config) == draft.config


def test_round_trip_identical_logits(tmp_path):
    draft = mla_draft(rope_scaling=YARN)
    batch = tiny_batch(draft.config)
    export_draft(draft, tmp_path / "fp32", dtype=torch.float32)
    export_draft(draft, tmp_path / "bf16")
    emb = draft.embed_tokens.weight
    fp32 = KimiK3Eagle3Draft.from_pretrained(tmp_path / "fp32", target_embedding=emb)
    bf16 = KimiK3Eagle3Draft.from_pretrained(tmp_path / "bf16", target_embedding=emb)
    assert type(fp32).__name__ == "DeepseekMLAEagle3Draft" and fp32.config == draft.config
    assert torch.equal(unroll(fp32, batch), unroll(draft, batch))
    reference = mla_draft(rope_scaling=YARN).to(torch.bfloat16)
    assert torch.equal(unroll(bf16, batch), unroll(reference, batch))


@torch.no_grad()
def unroll(draft, batch, steps=3):
    dtype = draft.fc.weight.dtype
    cache, h, ids, out = TTTCache(), draft.project(batch["aux_hidden_states"].to(dtype)), batch["input_ids"], []
    for k in range(steps):
        if k:
            ids = shift_left(ids)
        h = draft.layer(ids, h, batch["attention_mask"], cache)
        out.append(draft.logits(h))
    return torch.stack(out)


def test_trained_embedding_travels(tmp_path):
    draft = mla_draft(freeze_embeddings=False)
    _, weights = export(draft, tmp_path / "out")
    assert list(weights["embed_tokens.weight"].shape) == [256, 128]


@pytest.mark.parametrize(
    "source_overrides, kwargs, fragment",
    [
        ({}, {"aux_layer_ids": [1, 3, 6]}, "would be engine id 7, which vLLM never captures for a 6-layer target"),
        ({}, {"architecture": "Eagle3KimiK3ForCausalLM"}, "is exported as 'Eagle3DeepseekV2ForCausalLM'"),
    ],
)
def test_refusals_leave_nothing_behind(tmp_path, source_overrides, kwargs, fragment):
    draft = mla_draft(**source_overrides)
    with pytest.raises(ValueError, match=fragment):
        export_draft(draft, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_mixed_stream_exports_with_the_engine_setting(tmp_path):
    config, _ = export(mla_draft(aux_stream="mixed"), tmp_path / "out")
    assert config["serving_env"] == {"VLLM_KIMI_K3_AUX_ATTN_RES_STREAM": "1"}
    assert fmt.engine_config_from_json(config).aux_stream == "mixed"
    lines = fmt.serving_instructions(config, str(tmp_path / "out"))
    assert lines[0] == "engine setting the draft needs: VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1"
    assert lines[1].startswith(
        "serve: VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1 vllm serve <K3 checkpoint> --speculative-config"
    )


@pytest.mark.parametrize("fc_norm, norm_output", [(False, False), (True, False), (False, True), (True, True)])
def test_unsorted_aux_ids_export_sorted_with_fc_permuted(tmp_path, fc_norm, norm_output):
    """The engines sort the ids: the export sorts them and permutes fc's input chunks (and fc_norm) to match, so the
    re-imported draft fed the aux states in ascending-id order computes what ours computes in training order."""
    draft = mla_draft(aux_layer_ids=[5, 1, 3], fc_norm=fc_norm, norm_output=norm_output)
    config, weights = export(draft, tmp_path / "out", dtype=torch.float32)
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6] and config["aux_layer_ids"] == [1, 3, 5]
    assert (config["fc_norm"], config["norm_output"]) == (fc_norm, norm_output)
    loaded = KimiK3Eagle3Draft.from_pretrained(tmp_path / "out", target_embedding=draft.embed_tokens.weight)
    batch = tiny_batch(draft.config)
    a5, a1, a3 = batch["aux_hidden_states"].chunk(3, dim=-1)  # training order [5, 1, 3]
    sorted_batch = {**batch, "aux_hidden_states": torch.cat([a1, a3, a5], dim=-1)}
    # the same sums in another order: fp32 tolerance, not bit equality
    torch.testing.assert_close(unroll(loaded, sorted_batch), unroll(draft, batch), rtol=1e-5, atol=1e-5)


def test_tapping_layer_zero_warns_about_sglangs_plus_one(tmp_path):
    with pytest.warns(UserWarning, match="SGLang 0.5.23 adds 1 to every configured id when the first one is 1"):
        config, _ = export(mla_draft(aux_layer_ids=[0, 2, 4]), tmp_path / "out")
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]


def test_non_default_theta_without_scaling_warns(tmp_path):
    with pytest.warns(UserWarning, match="base 10000"):
        export_draft(mla_draft(rope_theta=50000.0), tmp_path / "out")


def test_a_foreign_export_of_the_format_imports(tmp_path):
    """A public draft of this format (TorchSpec native names ``midlayer.*``, frequency-ordered ``d2t``, no ``t2d``,
    no project fields) loads; target-id-space logits are unchanged by our ascending re-ordering."""
    draft = mla_draft(rope_scaling=YARN)
    config, weights = export(draft, tmp_path / "ours", dtype=torch.float32)
    perm = torch.randperm(72, generator=torch.Generator().manual_seed(0))
    selected = draft.selected_token_ids
    foreign = {k.replace("layers.0.", "midlayer."): v for k, v in weights.items() if k != "t2d"}
    foreign["lm_head.weight"] = weights["lm_head.weight"][perm].contiguous()
    foreign["d2t"] = selected[perm] - torch.arange(72)
    for name in ("aux_hidden_state_stream", "step_decay", "ttt_steps", "target_num_hidden_layers", "freeze_embeddings"):
        config.pop(name, None)
    (tmp_path / "foreign").mkdir()
    save_file(foreign, str(tmp_path / "foreign" / "model.safetensors"))
    (tmp_path / "foreign" / "config.json").write_text(json.dumps(config))
    loaded = KimiK3Eagle3Draft.from_pretrained(tmp_path / "foreign", target_embedding=draft.embed_tokens.weight)
    assert loaded.config.aux_layer_ids == [1, 3, 5] and loaded.config.aux_stream == "prefix"
    assert torch.equal(loaded.selected_token_ids, selected)
    batch = tiny_batch(draft.config)
    torch.testing.assert_close(unroll(loaded, batch), unroll(draft, batch), rtol=0, atol=0)


# ---- (a) the engines' weight-name mapping ----------------------------------------------------------------------------
def engine_parameters(config: dict, engine: str) -> dict[str, tuple[int, ...]]:
    """The parameter names and shapes ``Eagle3DeepseekV2ForCausalLM`` allocates from ``config.json`` (pinned sources).

    SGLang: ``model.midlayer.*``, ``self_attn.fused_qkv_a_proj_with_mqa`` (replaced for the 2H input), MLP
    ``gate_up_proj``; vLLM: ``model.layers.0.*``, ``self_attn.fused_qkv_a_proj`` (``input_size=2H``), ``gate_up_proj``
    and the top-level ``draft_id_to_target_id``."""
    H, n = config["hidden_size"], config["num_attention_heads"]
    q_lora, kv_lora, rope = config["q_lora_rank"], config["kv_lora_rank"], config["qk_rope_head_dim"]
    qk = config["qk_nope_head_dim"] + rope
    layer, fused = (
        ("model.midlayer.", "fused_qkv_a_proj_with_mqa")
        if engine == "sglang"
        else ("model.layers.0.", "fused_qkv_a_proj")
    )
    params = {
        "model.embed_tokens.weight": (config["vocab_size"], H),
        "model.fc.weight": (H, 3 * (config.get("target_hidden_size") or H)),
        f"{layer}input_layernorm.weight": (H,),
        f"{layer}hidden_norm.weight": (H,),
        f"{layer}post_attention_layernorm.weight": (H,),
        f"{layer}self_attn.{fused}.weight": (q_lora + kv_lora + rope, 2 * H),
        f"{layer}self_attn.q_a_layernorm.weight": (q_lora,),
        f"{layer}self_attn.q_b_proj.weight": (n * qk, q_lora),
        f"{layer}self_attn.kv_a_layernorm.weight": (kv_lora,),
        f"{layer}self_attn.kv_b_proj.weight": (n * (config["qk_nope_head_dim"] + config["v_head_dim"]), kv_lora),
        f"{layer}self_attn.o_proj.weight": (H, n * config["v_head_dim"]),
        f"{layer}mlp.gate_up_proj.weight": (2 * config["intermediate_size"], H),
        f"{layer}mlp.down_proj.weight": (H, config["intermediate_size"]),
        "model.norm.weight": (H,),
        "lm_head.weight": (config["draft_vocab_size"], H),
    }
    if engine == "vllm":
        params["draft_id_to_target_id"] = (config["draft_vocab_size"],)
    return params


class Loaded:
    """What a simulated loader did: ``params`` name → tensor (fused ones concatenated in shard order), names it
    skipped (SGLang warns, vLLM is silent), names it ignored by rule (``t2d``), and the draft→target id table."""

    def __init__(self):
        self.params: dict[str, torch.Tensor] = {}
        self.shards: dict[str, dict[int, torch.Tensor]] = {}
        self.skipped: list[str] = []
        self.ignored: list[str] = []
        self.target_ids: torch.Tensor | None = None

    def shard(self, name, index, tensor):
        self.shards.setdefault(name, {})[index] = tensor

    def finish(self):
        for name, parts in self.shards.items():
            assert name not in self.params, f"{name} loaded twice"
            self.params[name] = torch.cat([parts[i] for i in sorted(parts)], dim=0)
        return self


def sglang_load(weights: dict[str, torch.Tensor], params: dict) -> Loaded:
    """SGLang ``Eagle3DeepseekV2ForCausalLM.load_weights`` (kimi_k25_eagle3.py, pinned above), rule for rule."""
    out, cached = Loaded(), {}
    for name, tensor in weights.items():
        if name == "d2t" or name.endswith(".d2t"):
            out.target_ids = tensor + torch.arange(tensor.shape[0])  # hot_token_id: d2t are target − draft offsets
            continue
        if name == "t2d" or name.endswith(".t2d"):
            out.ignored.append(name)
            continue
        mapped = re.sub(r"^layers\.0\.", "midlayer.", name)
        if not mapped.startswith("lm_head."):
            mapped = f"model.{mapped}"
        handled = False
        for param_name, weight_name, shard_id in ((".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)):
            if weight_name in mapped and mapped.replace(weight_name, param_name) in params:
                out.shard(mapped.replace(weight_name, param_name), shard_id, tensor)
                handled = True
                break
        if handled:
            continue
        if "q_a_proj" in mapped or "kv_a_proj_with_mqa" in mapped:
            cached[mapped] = tensor
            q_name = mapped if "q_a_proj" in mapped else mapped.replace("kv_a_proj_with_mqa", "q_a_proj")
            kv_name = mapped if "kv_a_proj_with_mqa" in mapped else mapped.replace("q_a_proj", "kv_a_proj_with_mqa")
            if q_name in cached and kv_name in cached:
                fused = torch.cat([cached.pop(q_name), cached.pop(kv_name)], dim=0)
                fused_name = q_name.replace("q_a_proj", "fused_qkv_a_proj_with_mqa")
                if fused_name in params:
                    out.params[fused_name] = fused
                else:
                    out.skipped.append(fused_name)
            continue
        if mapped not in params:
            out.skipped.append(name)  # logger.warning("Eagle3 MLA: skipping unexpected weight %s", name)
            continue
        out.params[mapped] = tensor
    out.skipped += list(cached)  # a q_a_proj without its kv_a_proj_with_mqa never reaches a parameter
    return out.finish()


LOADERS = {"sglang": sglang_load}  # vLLM: its own loader, in tests/engine


@pytest.mark.parametrize("engine", ["sglang"])
@pytest.mark.parametrize("include_embeddings", [False, True])
def test_engine_loader_maps_every_export_name(tmp_path, engine, include_embeddings):
    draft = mla_draft(rope_scaling=YARN)
    config, weights = export(draft, tmp_path / "out", include_embeddings=include_embeddings)
    params = engine_parameters(config, engine)
    loaded = LOADERS[engine](weights, params)
    assert loaded.skipped == [], f"{engine} drops {loaded.skipped}"
    assert loaded.ignored == ["t2d"]  # both engines ignore t2d by rule; it is for our re-import
    shared = set() if include_embeddings else {"model.embed_tokens.weight"}  # the target's, shared by the engine
    assert set(loaded.params) == set(params) - shared, "missing or extra engine parameters"
    assert {k: tuple(v.shape) for k, v in loaded.params.items()} == {k: params[k] for k in loaded.params}
    assert torch.equal(loaded.target_ids, draft.selected_token_ids)  # d2t read as target − draft offsets


@pytest.mark.parametrize("engine", ["sglang"])
def test_negative_control_k3_weights_would_be_dropped(engine):
    """Why the K3-faithful draft must never carry an engine name: SGLang drops its g_proj with only a warning (vLLM
    0.32 refuses it loudly: tests/engine)."""
    k3 = tiny_draft()
    weights = {k.replace("midlayer.", "layers.0."): v for k, v in k3.state_dict().items() if k != "embed_tokens.weight"}
    config = {**k3.config.to_dict(), "target_hidden_size": 128}
    loaded = LOADERS[engine](weights, engine_parameters(config, engine))
    assert loaded.skipped == ["layers.0.self_attn.g_proj.weight"]


# ---- (b) the engine forward, re-implemented ----------------------------------------------------------------------
class EngineDraft:
    """Plain-torch ``Eagle3DeepseekV2ForCausalLM`` forward as the engines run it, from the export folder: the
    loader's fused tensors, the config fields the engine reads, one KV cache over absolute positions (causal by
    position), SGLang's fused-add RMSNorm, DeepSeek YaRN cos/sin table with interleaved pairs, mscale² softmax."""

    def __init__(self, folder, embedding: torch.Tensor):
        self.cfg = cfg = json.loads((folder / "config.json").read_text())
        w = {k: v.float() if v.is_floating_point() else v for k, v in load_file(folder / "model.safetensors").items()}
        p = sglang_load(w, engine_parameters(cfg, "sglang")).params  # the fused tensors the engine holds
        self.p, self.embedding = p, embedding.float()
        self.target_ids = w["d2t"] + torch.arange(w["d2t"].numel())
        self.eps, self.n = cfg["rms_norm_eps"], cfg["num_attention_heads"]
        self.d_nope, self.d_rope, self.d_v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        rs = cfg["rope_scaling"]
        base = rs["rope_theta"] if rs else cfg["rope_theta"]  # vLLM reads the theta from rope_scaling
        d = self.d_rope
        freqs = base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        scale = (self.d_nope + d) ** -0.5
        if rs is None:
            inv_freq, magnitude, rows = 1.0 / freqs, 1.0, cfg["max_position_embeddings"]
        else:
            s, orig = rs["factor"], rs["original_max_position_embeddings"]

            def mscale(m):
                return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

            def corr(rot):
                return d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

            low, high = max(math.floor(corr(rs["beta_fast"])), 0), min(math.ceil(corr(rs["beta_slow"])), d - 1)
            high = high + 0.001 if low == high else high
            mask = 1 - ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
            inv_freq = (1.0 / (s * freqs)) * (1 - mask) + (1.0 / freqs) * mask
            magnitude = mscale(rs["mscale"]) / mscale(rs["mscale_all_dim"])
            scale *= mscale(rs["mscale_all_dim"]) ** 2
            rows = int(orig * s)
        t = torch.arange(rows, dtype=torch.float32)
        angles = torch.einsum("i,j -> ij", t, inv_freq)
        self.cos_sin = torch.cat([angles.cos() * magnitude, angles.sin() * magnitude], dim=-1)
        self.scale = scale
        self.keys, self.values, self.key_pos = [], [], []

    def norm(self, x, weight, residual=None):
        if residual is not None:
            x = x + residual
            residual = x
        y = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight).to(x.dtype)
        return y if residual is None else (y, residual)

    def rope(self, x, positions):  # x [T, h, d]; is_neox_style=False
        cos, sin = self.cos_sin[positions].chunk(2, dim=-1)
        cos, sin = cos[:, None], sin[:, None]
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)

    def forward(self, ids, hidden, positions):
        """``ids [T]``, ``hidden [T,H]`` (prefix pass: ``[T,3H_t]`` aux, projected by fc), ``positions [T]`` →
        full-vocabulary logits ``[T,V]`` (−inf outside the draft vocabulary) and the pre-norm hidden."""
        p, m = self.p, "model.midlayer."
        if hidden.shape[-1] != self.embedding.shape[-1]:
            hidden = hidden @ p["model.fc.weight"].T
        T, n = ids.shape[0], self.n
        residual = hidden
        x = torch.cat(
            [
                self.norm(self.embedding[ids], p[m + "input_layernorm.weight"]),
                self.norm(hidden, p[m + "hidden_norm.weight"]),
            ],
            -1,
        )
        fused = x @ p[m + "self_attn.fused_qkv_a_proj_with_mqa.weight"].T  # [q_lora | kv_lora | rope]
        q_lora = p[m + "self_attn.q_a_layernorm.weight"].numel()
        q_lat, kv_a = fused.split([q_lora, fused.shape[-1] - q_lora], -1)
        q = (self.norm(q_lat, p[m + "self_attn.q_a_layernorm.weight"]) @ p[m + "self_attn.q_b_proj.weight"].T).view(
            T, n, -1
        )
        q_nope, q_pe = q.split([self.d_nope, self.d_rope], -1)
        latent, k_pe = kv_a.split([kv_a.shape[-1] - self.d_rope, self.d_rope], -1)
        kv = (self.norm(latent, p[m + "self_attn.kv_a_layernorm.weight"]) @ p[m + "self_attn.kv_b_proj.weight"].T).view(
            T, n, -1
        )
        k_nope, v = kv.split([self.d_nope, self.d_v], -1)
        q = torch.cat([q_nope, self.rope(q_pe, positions)], -1)
        k = torch.cat([k_nope, self.rope(k_pe[:, None], positions).expand(T, n, self.d_rope)], -1)
        self.keys.append(k), self.values.append(v), self.key_pos.append(positions)
        keys, values, key_pos = torch.cat(self.keys), torch.cat(self.values), torch.cat(self.key_pos)
        scores = torch.einsum("qhd,khd->hqk", q, keys) * self.scale
        scores = scores.masked_fill(key_pos[None, None, :] > positions[None, :, None], float("-inf"))
        o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(T, -1)
        attn = o @ p[m + "self_attn.o_proj.weight"].T
        h, residual = self.norm(attn, p[m + "post_attention_layernorm.weight"], residual)
        gate, up = (h @ p[m + "mlp.gate_up_proj.weight"].T).chunk(2, -1)
        mlp = (F.silu(gate) * up) @ p[m + "mlp.down_proj.weight"].T
        normed, prenorm = self.norm(mlp, p["model.norm.weight"], residual)
        draft_logits = normed @ p["lm_head.weight"].T
        full = draft_logits.new_full((T, self.embedding.shape[0]), float("-inf"))
        full[:, self.target_ids] = draft_logits
        return full, prenorm


@pytest.mark.parametrize("rope_scaling", [None, YARN])
@torch.no_grad()
def test_engine_forward_equals_our_ttt_steps(tmp_path, rope_scaling):
    draft = mla_draft(seed=3, rope_scaling=rope_scaling)
    with torch.no_grad():
        for p in draft.parameters():
            p.mul_(1.5)  # larger activations: the rotary and the attention pattern matter
    export_draft(draft, tmp_path / "out", dtype=torch.float32)
    engine = EngineDraft(tmp_path / "out", draft.embed_tokens.weight)
    g = torch.Generator().manual_seed(7)
    T, n, K = 12, 7, 4
    x = torch.randint(0, 256, (1, T), generator=g)
    aux = torch.randn(1, T, 384, generator=g)
    # Ours: the TTT unroll on the unshifted row (slot t at step k is judged at t+1+k).
    cache, h, ids, ours = TTTCache(), draft.project(aux), shift_left(x), []
    for k in range(K):
        if k:
            ids = shift_left(ids)
        h = draft.layer(ids, h, None, cache)
        ours.append(draft.logits(h)[0])
    selected = draft.selected_token_ids
    # Engine draft-extend over the prefix: slots 0..n-1 at positions 0..n-1, token x_{t+1} with hidden a_t.
    full, prenorm = engine.forward(x[0, 1 : n + 1], aux[0, :n], torch.arange(n))
    torch.testing.assert_close(full[:, selected], ours[0][:n], rtol=1e-4, atol=1e-5)
    assert torch.isinf(full).sum() == n * (256 - 72)
    # Engine draft decode steps from the last slot n-1: position n-1+j, its own chain keys in the same KV cache.
    hidden = prenorm[-1:]
    for j in range(1, K):
        full, hidden = engine.forward(x[0, n + j : n + j + 1], hidden, torch.tensor([n - 1 + j]))
        torch.testing.assert_close(full[0, selected], ours[j][n - 1], rtol=1e-4, atol=1e-5)


def test_an_export_missing_a_tensor_is_refused_by_our_completeness_check(tmp_path):
    """vLLM 0.32 would load it: its load_weights returns None, so nothing reports half of gate_up_proj unset."""
    from lightning_eagle.draft.pretrained import check_export

    _, weights = export(mla_draft(), tmp_path / "out")
    weights.pop("layers.0.mlp.up_proj.weight")
    save_file(weights, str(tmp_path / "out" / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"does not match .*config.json: export key set mismatch: missing \['midlayer.mlp.up_proj.weight'\]",
    ):
        check_export(tmp_path / "out")
