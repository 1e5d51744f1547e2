"""Write a :class:`KimiK3ForCausalLM` in the released checkpoint layout (the inverse of the loader).

Used to build synthetic targets (tests, the quickstart's tiny target) and to round-trip the loader. The directory is
written atomically: a sibling temp dir is filled, then renamed into place.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from lightning_eagle.atomic import atomic_dir, weights_folder_problem
from lightning_eagle.k3.loader import TEXT_PREFIX
from lightning_eagle.k3.mxfp4 import decode_mxfp4, encode_mxfp4

MXFP4_QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "format": "mxfp4-pack-quantized",
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
                        "scale_dtype": "torch.uint8"},
        }
    },
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
}  # fmt: skip


def checkpoint_state_dict(model, mxfp4: bool = True, prefix: str = TEXT_PREFIX) -> dict[str, torch.Tensor]:
    """Released key names: unstacked ``experts.{e}.w{1,2,3}`` (MXFP4 packed when ``mxfp4``), zero-padded ``A_log``."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        t = p.detach().cpu()
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            continue
        if name.endswith("A_log"):
            t = torch.cat([t, t.new_zeros(math.ceil(t.shape[0] / 128) * 128 - t.shape[0])])
        out[prefix + name] = t.contiguous()
    for mod_name, module in model.named_modules():
        if type(module).__name__ != "RoutedExperts":
            continue
        inter = module.intermediate_size
        for local in range(module.count):
            e = module.start + local
            if module.storage == "mxfp4":  # already packed: write the stored bytes
                stored = {"w1": slice(0, inter), "w3": slice(inter, 2 * inter)}
                for w, rows in stored.items():
                    out[f"{prefix}{mod_name}.{e}.{w}.weight_packed"] = module.gate_up_packed[local, rows].cpu().clone()
                    out[f"{prefix}{mod_name}.{e}.{w}.weight_scale"] = module.gate_up_scale[local, rows].cpu().clone()
                out[f"{prefix}{mod_name}.{e}.w2.weight_packed"] = module.down_packed[local].cpu().clone()
                out[f"{prefix}{mod_name}.{e}.w2.weight_scale"] = module.down_scale[local].cpu().clone()
                continue
            weights = {
                "w1": module.gate_up_proj[local, :, :inter].t(),
                "w3": module.gate_up_proj[local, :, inter:].t(),
                "w2": module.down_proj[local].t(),
            }
            for w, weight in weights.items():
                stem = f"{prefix}{mod_name}.{e}.{w}"
                if mxfp4:
                    packed, scale = encode_mxfp4(weight.detach().cpu())
                    out[stem + ".weight_packed"], out[stem + ".weight_scale"] = packed, scale
                else:
                    out[stem + ".weight"] = weight.detach().cpu().contiguous()
    return out


@torch.no_grad()
def snap_experts_to_mxfp4(model):
    """Round routed experts onto the MXFP4 grid they will be stored in (in place), so that a model written with
    ``mxfp4=True`` is the model that was evaluated before writing. Returns ``model``."""
    for module in model.modules():
        if type(module).__name__ == "RoutedExperts":
            for e in range(module.count):
                for w in (module.gate_up_proj[e], module.down_proj[e]):
                    w.copy_(decode_mxfp4(*encode_mxfp4(w.t())).t())
    return model


def previous_checkpoint_problem(folder: Path) -> str | None:
    """Why ``folder`` is not a K3 checkpoint this writer wrote before (None: it is one, or empty)."""
    return weights_folder_problem(folder, frozenset({"KimiK3ForConditionalGeneration", "KimiLinearForCausalLM"}))


def save_k3_checkpoint(
    model,
    out_dir: str | Path,
    mxfp4: bool = True,
    num_shards: int = 1,
    vlm_wrapper: bool = True,
    extra_tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``config.json`` + safetensors (sharded with an index when ``num_shards > 1``)."""
    out_dir = Path(out_dir)
    state = checkpoint_state_dict(model, mxfp4=mxfp4, prefix=TEXT_PREFIX if vlm_wrapper else "")
    state.update(extra_tensors or {})
    text = model.config.to_dict()
    for key in ("transformers_version", "_name_or_path"):
        text.pop(key, None)
    text["architectures"] = ["KimiLinearForCausalLM"]
    if mxfp4:
        text["quantization_config"] = MXFP4_QUANTIZATION_CONFIG
    config = text
    if vlm_wrapper:
        config = {
            "architectures": ["KimiK3ForConditionalGeneration"],
            "model_type": "kimi_k3",
            "bos_token_id": text.get("bos_token_id"),
            "eos_token_id": text.get("eos_token_id"),
            "pad_token_id": text.get("pad_token_id"),
            "tie_word_embeddings": False,
            "text_config": text,
            "vision_config": {},
        }
    with atomic_dir(out_dir, overwrite=True, replaceable=previous_checkpoint_problem) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
        keys = sorted(state)
        if num_shards <= 1:
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            per = math.ceil(len(keys) / num_shards)
            weight_map = {}
            for s in range(num_shards):
                name = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
                chunk = {k: state[k] for k in keys[s * per : (s + 1) * per]}
                save_file(chunk, str(tmp / name), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(chunk, name))
            total = sum(t.numel() * t.element_size() for t in state.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1, sort_keys=True))
    return out_dir
