"""Load a draft folder: our serving export (``midlayer.*``), its engine format for ``deepseek_mla`` drafts
(``Eagle3DeepseekV2ForCausalLM``: ``layers.0.*``, also the public drafts of that format), or a NeMo Automodel export
(``model.layers.0.*``).

Both single-file (``model.safetensors``) and sharded (``model.safetensors.index.json``) folders are read. After the
layout adapter, the state must pass the same strict key/shape/dtype check the exporter applies, then it is assigned to
a draft built on the meta device (no wasted random init of a 2.6 B-parameter model) by
:meth:`~lightning_eagle.draft.KimiK3Eagle3Draft.from_pretrained`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from lightning_eagle.draft import reference_import
from lightning_eagle.draft import serving_format as fmt
from lightning_eagle.draft.config import Eagle3DraftConfig

INDEX_NAME = "model.safetensors.index.json"


def weights_source(folder: Path) -> Path:
    """The file the weights are read from: ``model.safetensors``, else the shard index."""
    single = folder / fmt.WEIGHTS_NAME
    return single if single.is_file() else folder / INDEX_NAME


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    return read_weights_and_ids(folder)[0]


def read_weights_and_ids(folder: Path) -> tuple[dict[str, torch.Tensor], set[str | None]]:
    """The tensors of the folder's single file or shards, each file checked finite (naming it and the tensor), and
    the write ids the files carry (:func:`~lightning_eagle.draft.serving_format.read_snapshot`)."""
    single = folder / fmt.WEIGHTS_NAME
    if single.is_file():
        state, write_id = fmt.read_safetensors(single)
        fmt.check_finite(state, str(single))
        return state, {write_id}
    index = folder / INDEX_NAME
    if not index.is_file():
        raise FileNotFoundError(f"{folder} has neither {fmt.WEIGHTS_NAME} nor {INDEX_NAME}")
    try:
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{index}: not a safetensors index (expected a 'weight_map' object; {err!r})") from None
    shards = sorted(set(weight_map.values()))
    absent = [shard for shard in shards if not (folder / shard).is_file()]
    if absent:
        raise FileNotFoundError(f"{index}: lists shard(s) {absent}, which do not exist in {folder}")
    state: dict[str, torch.Tensor] = {}
    ids: set[str | None] = set()
    for shard in shards:
        part, write_id = fmt.read_safetensors(folder / shard)
        fmt.check_finite(part, str(folder / shard))
        state.update(part)
        ids.add(write_id)
    missing = sorted(set(weight_map) - set(state))
    if missing:
        raise ValueError(f"{index}: keys listed but absent from the shards: {missing[:5]}")
    return state, ids


def _read_config(folder: Path) -> dict:
    config_file = folder / fmt.CONFIG_NAME
    if not config_file.is_file():
        what = "does not exist" if not folder.exists() else f"has no {fmt.CONFIG_NAME}"
        raise FileNotFoundError(
            f"draft folder {str(folder)!r} {what} (expected a draft export: {fmt.CONFIG_NAME} + {fmt.WEIGHTS_NAME})"
        )
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_file}: invalid JSON ({err})") from None


def _float_dtype(config_json: dict, config_file: Path) -> torch.dtype | None:
    """``config.json``'s ``torch_dtype`` as a float dtype (None when absent); anything else is refused by name."""
    name = config_json.get("torch_dtype")
    if name is None:
        return None
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{config_file}: torch_dtype {name!r} is not a floating dtype (e.g. 'bfloat16', 'float32')")
    return dtype


def check_export(path: str | os.PathLike) -> tuple[Eagle3DraftConfig, dict[str, torch.Tensor]]:
    """Read a draft folder and check every tensor against its ``config.json``: the exact key set the config implies
    (what the engine class allocates: vLLM's loader does not report a missing tensor, it leaves the parameter
    uninitialised), shapes, dtypes and the vocabulary map. Returns the config and the state under our names; the
    exporter runs it on what it wrote before the folder takes its final name."""
    folder = Path(path)
    config_file = folder / fmt.CONFIG_NAME
    # one write's config and tensors, even while a fit replaces the folder (serving_format.read_snapshot)
    config_json, state = fmt.read_snapshot(folder, lambda: _read_config(folder), lambda: read_weights_and_ids(folder))
    weights = weights_source(folder)
    reference = reference_import.is_reference_layout(state)
    float_dtype = None if reference else _float_dtype(config_json, config_file)  # foreign drafts: as they are
    try:
        if fmt.is_engine_layout(config_json):
            config = fmt.engine_config_from_json(config_json)
        elif reference_import.is_reference_layout(state):
            config = reference_import.config_from_reference(config_json)
        elif any(k.startswith("midlayer.") for k in state):
            config = fmt.config_from_json(config_json)
        else:
            raise ValueError(f"{weights}: unknown draft layout (neither midlayer.* nor model.layers.0.* keys)")
    except (TypeError, ValueError, KeyError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
        raise ValueError(message if message.startswith(str(folder)) else f"{config_file}: {message}") from None
    try:
        if fmt.is_engine_layout(config_json):
            state = fmt.engine_state_to_draft(state, config)
        elif reference_import.is_reference_layout(state):
            state = reference_import.convert_reference_state(state, config)
        fmt.check_state(state, config, include_embeddings="embed_tokens.weight" in state, float_dtype=float_dtype)
    except ValueError as err:  # key set / shape / dtype against config.json: name both files
        raise ValueError(f"{weights} does not match {config_file}: {err}") from None

    return config, state
