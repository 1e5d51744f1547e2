"""Load a draft folder: our serving export (``midlayer.*``) or a NeMo Automodel export (``model.layers.0.*``).

Both single-file (``model.safetensors``) and sharded (``model.safetensors.index.json``) folders are read. After the
layout adapter, the state must pass the same strict key/shape/dtype check the exporter applies, then it is assigned to
a draft built on the meta device (no wasted random init of a 2.6 B-parameter model).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file

from lightning_eagle.draft import reference_import
from lightning_eagle.draft import serving_format as fmt
from lightning_eagle.draft.model import KimiK3Eagle3Draft

INDEX_NAME = "model.safetensors.index.json"


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    single = folder / fmt.WEIGHTS_NAME
    if single.is_file():
        return load_file(str(single))
    index = folder / INDEX_NAME
    if not index.is_file():
        raise FileNotFoundError(f"{folder} has neither {fmt.WEIGHTS_NAME} nor {INDEX_NAME}")
    weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        state.update(load_file(str(folder / shard)))
    missing = sorted(set(weight_map) - set(state))
    if missing:
        raise ValueError(f"{index}: keys listed but absent from the shards: {missing[:5]}")
    return state


def load_pretrained(
    path: str | os.PathLike,
    *,
    target_embedding: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    attention_backend: str = "eager",
) -> KimiK3Eagle3Draft:
    """Build a :class:`KimiK3Eagle3Draft` from ``path``.

    Tensors keep their stored dtype unless ``dtype`` is given. An export without ``embed_tokens.weight`` (frozen
    embedding omitted, §14.1) needs the target's: pass ``target_embedding`` or call ``copy_embeddings_from`` later;
    until then the embedding is NaN so that an accidental use fails loudly instead of drafting garbage.
    """
    folder = Path(path)
    config_json = json.loads((folder / fmt.CONFIG_NAME).read_text())
    state = read_weights(folder)
    if reference_import.is_reference_layout(state):
        config = reference_import.config_from_reference(config_json)
        state = reference_import.convert_reference_state(state, config)
    elif any(k.startswith("midlayer.") for k in state):
        config = fmt.config_from_json(config_json)
    else:
        raise ValueError(f"{folder}: unknown draft layout (neither midlayer.* nor model.layers.0.* keys)")
    has_embeddings = "embed_tokens.weight" in state
    fmt.check_state(state, config, include_embeddings=has_embeddings)

    with torch.device("meta"):
        draft = KimiK3Eagle3Draft(config, attention_backend=attention_backend)
    if not has_embeddings:
        if target_embedding is not None:
            if hasattr(target_embedding, "full_tensor"):
                target_embedding = target_embedding.full_tensor()
            state["embed_tokens.weight"] = target_embedding.detach().to(state["fc.weight"].dtype).clone()
        else:
            warnings.warn(
                f"{folder} has no embed_tokens.weight (frozen embedding omitted); the draft's embedding is NaN until "
                "copy_embeddings_from(target embed_tokens.weight) is called",
                stacklevel=3,
            )
            shape = (config.vocab_size, config.hidden_size)
            state["embed_tokens.weight"] = torch.full(shape, float("nan"), dtype=state["fc.weight"].dtype)
    draft.load_state_dict(state, strict=True, assign=True)
    if config.freeze_embeddings:
        draft.freeze_embeddings()
    if dtype is not None:
        draft.to(dtype)
    return draft.to(device)
