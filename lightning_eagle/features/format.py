"""On-disk layout of dumped target features (one folder, written by ``cli.py dump``, read by
:class:`~lightning_eagle.features.datamodule.HiddenStateDataModule`).

::

    features/
      plan.json                  what is being dumped (target, taps, data, vocab map, rows): written first
      vocab_map.safetensors      the data module's d2t / t2d (the offline run trains with exactly this map)
      prompts.json               the validation rows' prompts the online run decodes for val/tau_real
      shard-00000.safetensors    rows [0, R) : tokens concatenated, ``offsets [rows+1]`` delimit the rows
      shard-00000.json           its row count, token count and sha256 (written after the shard: "complete")
      …
      manifest.json              plan + the shard list + totals: written last, once every shard is complete

A shard holds ``input_ids`` (int32) and ``loss_mask`` (uint8) — *unshifted*, as the data module produced them —
``aux_hidden_states [tokens, 3H]`` and ``hidden_states [tokens, H]`` (the final hidden **before** the final norm by
default; the manifest's ``hidden_states`` says ``"prenorm"`` or ``"postnorm"``), plus ``offsets`` and ``row_ids``
(global row numbers). Rows ``[0, train_rows)`` are the online run's training split in its order, then its
validation rows, so the offline run splits, shuffles and batches exactly like the online one.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from lightning_eagle.atomic import atomic_file
from lightning_eagle.dtypes import DTYPES
from lightning_eagle.k3.target_spec import TargetSpec

FORMAT = "lightning_eagle.features/1"
PLAN_NAME, MANIFEST_NAME, VOCAB_MAP_NAME = "plan.json", "manifest.json", "vocab_map.safetensors"
PROMPTS_NAME = "prompts.json"  # held-out prompts (token ids) for real speculative decoding, as the online run uses
HIDDEN_KINDS = ("prenorm", "postnorm")
# Fields of the plan that must agree between a dump and what reads or resumes it.
IDENTITY_FIELDS = ("format", "target", "aux_layer_ids", "aux_stream", "hidden_states", "dtype", "data", "vocab_map")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def target_fingerprint(spec: TargetSpec) -> dict[str, Any]:
    """The spec's config hash (the same 16 hex digits ``Eagle3Module`` checks on resume) and the weight files' sizes."""
    files = {p.name: p.stat().st_size for p in sorted(spec.path.glob("*.safetensors"))}
    return {"config_sha256": spec.fingerprint, "weight_files": files}


def bytes_per_token(hidden_size: int, num_aux: int, dtype: str) -> int:
    """Disk bytes of one dumped token: the taps and the final hidden, plus its id (int32) and mask (uint8)."""
    return (num_aux + 1) * hidden_size * DTYPES[dtype].itemsize + 4 + 1


def write_json(path: Path, data: dict[str, Any]) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON ({exc})") from None


@dataclass
class ShardRows:
    """Rows collected for one shard, in row-id order."""

    input_ids: list[torch.Tensor]
    loss_mask: list[torch.Tensor]
    aux_hidden_states: list[torch.Tensor]
    hidden_states: list[torch.Tensor]
    row_ids: list[int]


def write_shard(folder: Path, index: int, rows: ShardRows, dtype: torch.dtype) -> dict[str, Any]:
    """Write one shard atomically, then its sidecar (the shard is complete only once the sidecar exists)."""
    lengths = torch.tensor([t.numel() for t in rows.input_ids], dtype=torch.int64)
    tensors = {
        "input_ids": torch.cat(rows.input_ids).to(torch.int32),
        "loss_mask": torch.cat(rows.loss_mask).to(torch.uint8),
        "aux_hidden_states": torch.cat(rows.aux_hidden_states).to(dtype).contiguous(),
        "hidden_states": torch.cat(rows.hidden_states).to(dtype).contiguous(),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
        "row_ids": torch.tensor(rows.row_ids, dtype=torch.int64),
    }
    path = folder / shard_name(index)
    with atomic_file(path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": FORMAT})
    info = {"shard": path.name, "rows": len(rows.row_ids), "tokens": int(lengths.sum()), "sha256": sha256_file(path)}
    write_json(path.with_suffix(".json"), info)
    return info


def complete_shard(folder: Path, index: int, expected_rows: int, verify: bool = True) -> dict[str, Any] | None:
    """The sidecar of shard ``index`` if the shard is complete (and its checksum verifies), else None."""
    path, sidecar = folder / shard_name(index), folder / shard_name(index).replace(".safetensors", ".json")
    if not (path.is_file() and sidecar.is_file()):
        return None
    try:
        info = read_json(sidecar)
    except ValueError:
        return None
    if info.get("rows") != expected_rows or (verify and sha256_file(path) != info.get("sha256")):
        return None
    return info


def shard_problem(path: Path, info: dict[str, Any], checksum: bool) -> str | None:
    """Why the shard at ``path`` is not the one the manifest recorded (``info``), or None. Always: the file is at least
    as long as its safetensors header says (a truncated copy fails here, cheaply); with ``checksum``: its sha256."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len)) if 0 < header_len <= size - 8 else None
    except (OSError, ValueError):
        header = None
    if not isinstance(header, dict):
        return f"{size} bytes with no readable safetensors header (truncated or not a shard)"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if size < 8 + header_len + end:
        return f"{size} bytes, its header describes {8 + header_len + end}: truncated"
    if checksum and sha256_file(path) != info.get("sha256"):
        return f"sha256 differs from the manifest's ({str(info.get('sha256'))[:12]}…): the bytes are damaged"
    return None
