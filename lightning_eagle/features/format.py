"""On-disk layout of dumped target features (one folder, written by ``cli.py dump``, read by
:class:`~lightning_eagle.features.datamodule.HiddenStateDataModule`).

::

    features/
      plan.json                  what is being dumped (target, taps, data, vocab map, rows): written first
      vocab_map.safetensors      the data module's d2t / t2d (the offline run trains with exactly this map)
      prompts.json               the validation rows' prompts the online run decodes for val/tau_real
      shard-00000.safetensors    rows [0, R_0) : tokens concatenated, ``offsets [rows+1]`` delimit the rows
      shard-00000.json           its row count, token count and sha256 (written after the shard: "complete")
      …
      manifest.json              plan + the shard list + totals: written last, once every shard is complete

A shard holds ``input_ids`` (int32) and ``loss_mask`` (uint8) — *unshifted*, as the data module produced them —
``aux_hidden_states [tokens, 3H]`` and ``hidden_states [tokens, H]`` (the final hidden **before** the final norm by
default; the manifest's ``hidden_states`` says ``"prenorm"`` or ``"postnorm"``), plus ``offsets`` and ``row_ids``
(global row numbers). Shard ``k`` holds the rows that follow shard ``k-1``'s: at most ``shard_rows`` rows and, with
``shard_tokens``, at most that many tokens (a longer row is a shard of its own); the sidecars' ``rows`` say how many
(:func:`shard_bounds`). Rows ``[0, train_rows)`` are the online run's training split in its order, then its
validation rows, so the offline run splits, shuffles and batches exactly like the online one.
"""

from __future__ import annotations

import hashlib
import json
import re
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
PROGRESS_NAMES = ("producer.json", "consumer.json")  # a streaming run's progress (features.progress)
PROMPTS_NAME = "prompts.json"  # held-out prompts (token ids) for real speculative decoding, as the online run uses
HIDDEN_KINDS = ("prenorm", "postnorm")
# Fields of the plan that must agree between a dump and what reads or resumes it.
IDENTITY_FIELDS = ("format", "target", "aux_layer_ids", "aux_stream", "hidden_states", "dtype", "data", "vocab_map")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def foreign_entries(folder: Path) -> list[str]:
    """What in ``folder`` a dump did not write (a user's files, checkpoints, logs): a dump goes only into a new or
    empty folder or a previous dump, never mixed with other files (``export`` refuses the same)."""
    if not folder.is_dir():
        return []
    ours = {PLAN_NAME, MANIFEST_NAME, VOCAB_MAP_NAME, Path(VOCAB_MAP_NAME).with_suffix(".json").name, PROMPTS_NAME,
            *PROGRESS_NAMES}  # fmt: skip
    shard = re.compile(r"shard-\d{5}\.(safetensors|json)$")
    return sorted(
        p.name
        for p in folder.iterdir()
        if not (p.name in ours or shard.match(p.name) or p.name.endswith(".partial")) or p.is_dir()
    )


def plan_shard_bounds(lengths: list[int], shard_rows: int, shard_tokens: int | None = None) -> list[int]:
    """Row boundaries ``[0, b_1, …, n]`` of the shards of rows with token counts ``lengths``: consecutive rows, a new
    shard when ``shard_rows`` rows or (with ``shard_tokens``) that many tokens would be exceeded. A shard is collected
    in host memory before it is written, so the token budget bounds the dump's host memory whatever the row lengths."""
    bounds, rows, tokens = [0], 0, 0
    for i, n in enumerate(lengths):
        if rows and (rows == shard_rows or (shard_tokens is not None and tokens + n > shard_tokens)):
            bounds.append(i)
            rows, tokens = 0, 0
        rows, tokens = rows + 1, tokens + n
    if len(lengths):
        bounds.append(len(lengths))
    return bounds if len(bounds) > 1 else [0, 0]  # no rows: one empty shard, as before


def shard_bounds(manifest: dict[str, Any]) -> list[int]:
    """Row boundaries ``[0, b_1, …, n]`` of a finished dump's shards, from the manifest's per-shard row counts."""
    bounds = [0]
    for shard in manifest["shards"]:
        bounds.append(bounds[-1] + int(shard["rows"]))
    return bounds


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def target_fingerprint(spec: TargetSpec) -> dict[str, Any]:
    """The spec's config hash (the 16 hex digits a draft-training module checks on resume) and the weight files'
    sizes."""
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


_ROW_FIELDS = ("input_ids", "loss_mask", "aux_hidden_states", "hidden_states")


class ShardBuffer:
    """One shard being collected: its tensors allocated once at their final size (the rows' token counts are known
    from the plan), each row copied in at its offset as it arrives, in any order and from any device. Host memory is
    then exactly the shard's bytes on disk: no per-row copies, no concatenation when it is written."""

    def __init__(self, row_ids: list[int], lengths: list[int], dtype: torch.dtype) -> None:
        self.row_ids, self.dtype = list(row_ids), dtype
        self.index = {r: i for i, r in enumerate(self.row_ids)}
        counts = torch.tensor(lengths, dtype=torch.int64)
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
        self.filled = [False] * len(self.row_ids)
        self.tensors: dict[str, torch.Tensor] = {}

    def put(self, row_id: int, *row: torch.Tensor) -> None:
        """Copy row ``row_id``'s ``input_ids [n]``, ``loss_mask [n]``, ``aux_hidden_states [n,3H]`` and
        ``hidden_states [n,H]`` (cast to the storage dtypes) into place."""
        i = self.index[row_id]
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        if row[0].shape[0] != b - a:
            raise RuntimeError(f"row {row_id} has {row[0].shape[0]} tokens, the dump's plan counted {b - a}")
        if not self.tensors:
            n = int(self.offsets[-1])
            self.tensors = {
                "input_ids": torch.empty(n, dtype=torch.int32),
                "loss_mask": torch.empty(n, dtype=torch.uint8),
                "aux_hidden_states": torch.empty(n, row[2].shape[-1], dtype=self.dtype),
                "hidden_states": torch.empty(n, row[3].shape[-1], dtype=self.dtype),
            }
        for name, value in zip(_ROW_FIELDS, row):
            self.tensors[name][a:b].copy_(value)
        self.filled[i] = True

    @property
    def complete(self) -> bool:
        return all(self.filled)


def write_shard(
    folder: Path, index: int, rows: ShardRows | ShardBuffer, dtype: torch.dtype, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Write one shard atomically, then its sidecar (the shard is complete only once the sidecar exists); ``extra``:
    more sidecar fields (e.g. the engine version that extracted it)."""
    if isinstance(rows, ShardBuffer):
        if not rows.complete:
            raise RuntimeError(f"shard {index} is written before all its rows arrived")
        tensors = {**rows.tensors, "offsets": rows.offsets}
    else:
        lengths = torch.tensor([t.numel() for t in rows.input_ids], dtype=torch.int64)
        tensors = {
            "input_ids": torch.cat(rows.input_ids).to(torch.int32),
            "loss_mask": torch.cat(rows.loss_mask).to(torch.uint8),
            "aux_hidden_states": torch.cat(rows.aux_hidden_states).to(dtype).contiguous(),
            "hidden_states": torch.cat(rows.hidden_states).to(dtype).contiguous(),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
        }
    tensors["row_ids"] = torch.tensor(rows.row_ids, dtype=torch.int64)
    path = folder / shard_name(index)
    with atomic_file(path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": FORMAT})
    info = {"shard": path.name, "rows": len(rows.row_ids), "tokens": int(tensors["offsets"][-1]),
            "sha256": sha256_file(path), **(extra or {})}  # fmt: skip
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
