"""What a features folder will hold, decided before any forward: the rows (the data module's training split in order,
then its validation rows), their shards, and ``plan.json``. Shared by both producers of the format: our target
(``cli.py dump``) and a serving engine (``cli.py extract``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from lightning_eagle.atomic import check_writable, remove_partials
from lightning_eagle.features import format as fmt
from lightning_eagle.k3.target_spec import TargetSpec


class PlanRows:
    """The training split then the validation rows, read from the data module's datasets when a batch is built (the
    cache is memory-mapped: holding every row as int64 tensors would take 16 bytes per token of host memory)."""

    def __init__(self, train, val) -> None:
        self.parts = [p for p in (train, val) if p is not None]
        self.counts = [len(p) for p in self.parts]

    def __len__(self) -> int:
        return sum(self.counts)

    def __getitem__(self, row: int) -> dict[str, torch.Tensor]:
        for part, count in zip(self.parts, self.counts):
            if row < count:
                return part[row]
            row -= count
        raise IndexError(row)

    def lengths(self) -> list[int]:
        return [n for p in self.parts for n in _lengths(p)]


def _lengths(dataset) -> list[int]:
    if hasattr(dataset, "lengths"):
        return [int(n) for n in dataset.lengths()]
    return [int(dataset[i]["input_ids"].numel()) for i in range(len(dataset))]


@dataclasses.dataclass
class FeaturesPlan:
    """The rows of a features folder and their shards: shard ``k`` holds rows ``[bounds[k], bounds[k+1])``."""

    plan: dict[str, Any]
    rows: PlanRows
    lengths: list[int]
    bounds: list[int]

    @property
    def num_shards(self) -> int:
        return len(self.bounds) - 1

    def shard_rows(self, shard: int) -> list[int]:
        return list(range(self.bounds[shard], self.bounds[shard + 1]))

    def shard_tokens(self, shard: int) -> int:
        return sum(self.lengths[self.bounds[shard] : self.bounds[shard + 1]])


def features_plan(
    spec: TargetSpec,
    data,
    *,
    dtype: str,
    hidden_kind: str,
    shard_rows: int,
    shard_tokens: int | None,
    num_aux: int | None = None,
) -> FeaturesPlan:
    """Number ``data``'s rows (its ``setup("fit")`` runs) and cut them into shards; ``plan.json``'s content."""
    data.setup("fit")
    rows = PlanRows(data.train_dataset, data.val_dataset or None)
    lengths = rows.lengths()
    train_count = len(data.train_dataset)
    hidden, aux_ids = spec.config.hidden_size, list(spec.aux_layer_ids)
    mapping = data.vocab_mapping
    bounds = fmt.plan_shard_bounds(lengths, shard_rows, shard_tokens)
    plan = {
        "format": fmt.FORMAT,
        "target": fmt.target_fingerprint(spec),
        "aux_layer_ids": aux_ids,
        "aux_stream": spec.aux_stream,
        "hidden_states": hidden_kind,
        "dtype": dtype,
        "hidden_size": hidden,
        "num_aux_hidden_states": len(aux_ids) if num_aux is None else num_aux,
        "vocab_size": data.vocab_size,
        "pad_token_id": data.pad_token_id,
        "data": {
            **data.state_dict(),
            "train_position": None,
            "render_options": data.render_options,
            "max_length": data.max_length,
            "tokenizer": data.tokenizer.fingerprint,
        },  # fmt: skip
        "vocab_map": {"fingerprint": mapping.fingerprint, "draft_vocab_size": int(mapping.selected.numel())},
        "shard_rows": shard_rows,
        **({} if shard_tokens is None else {"shard_tokens": shard_tokens}),  # older plans have none
        "rows": {"train": train_count, "val": len(rows) - train_count},
        "tokens": sum(lengths),
        "bytes_per_token": fmt.bytes_per_token(hidden, len(aux_ids), dtype),
        "num_shards": len(bounds) - 1,
    }
    return FeaturesPlan(plan, rows, lengths, bounds)


def refuse_foreign_files(out_dir: Path, verb: str, flag: str) -> None:
    """A features folder is new, empty or a previous run of the same features: never mixed with other files."""
    foreign = fmt.foreign_entries(out_dir)
    if foreign:
        raise FileExistsError(
            f"refusing to {verb} into {out_dir}: it holds files a dump did not write ({', '.join(foreign[:5])}"
            f"{', …' if len(foreign) > 5 else ''}); a dump goes into a new or empty folder or a previous dump of the "
            f"same features: pass another {flag}"
        )


def start_folder(out_dir: Path, plan: dict[str, Any], data) -> None:
    """Create the folder (its half-written files removed) and write ``plan.json``, the vocabulary map and the held-out
    prompts, unless a previous run of the same plan is there (then nothing is rewritten)."""
    from lightning_eagle.data.prompts import prompts_from_datamodule

    check_writable(out_dir, "the features folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_partials(out_dir)  # a killed run's half-written files
    if not (out_dir / fmt.PLAN_NAME).is_file():
        data.vocab_mapping.save(out_dir / fmt.VOCAB_MAP_NAME, {"features": str(out_dir)})
        fmt.write_json(out_dir / fmt.PROMPTS_NAME, {"prompts": prompts_from_datamodule(data)})
        fmt.write_json(out_dir / fmt.PLAN_NAME, plan)  # last: a plan.json means the folder's other files are there


def check_same_plan(out_dir: Path, plan: dict[str, Any], fields: tuple[str, ...]) -> None:
    """The folder's ``plan.json`` must describe the features this run makes (a resumed run adds to the same dump)."""
    old = fmt.read_json(out_dir / fmt.PLAN_NAME)
    for key in (*fmt.IDENTITY_FIELDS, *fields):
        if old.get(key) != plan.get(key):
            raise ValueError(
                f"{out_dir} holds a dump of other features ({key}: {old.get(key)!r} there, {plan.get(key)!r} now); "
                "pass another --out or delete the folder"
            )


def write_manifest(out_dir: Path, plan: dict[str, Any], shard_info, run: str) -> dict[str, Any]:
    """After every shard is written: ``manifest.json`` = the plan plus every shard's sidecar (``shard_info(k)``, None
    when shard ``k`` is not there, which refuses the manifest). ``run``: what wrote them, for the message."""
    shards, missing = [], []
    for k in range(plan["num_shards"]):
        info = shard_info(k)
        (shards.append(info) if info is not None else missing.append(fmt.shard_name(k)))
    if missing:
        raise RuntimeError(f"{out_dir}: shards {missing[:5]} are incomplete after the {run}; run it again")
    manifest = {**plan, "shards": shards}
    fmt.write_json(out_dir / fmt.MANIFEST_NAME, manifest)
    return manifest
