"""``HiddenStateDataModule``: batches of dumped target features (``cli.py dump``) for a draft-training module with
``model.target.source: features`` — the same rows, split, shuffle order, padding and resumable position as the
online run's ``ChatDataModule``, with ``aux_hidden_states`` and ``hidden_states`` added to each batch (no target
forward)."""

from __future__ import annotations

import bisect
import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from safetensors import safe_open
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_eagle.data.dataset import collate_chat_rows
from lightning_eagle.data.sampler import ResumableDataLoader, ResumableTrainLoader
from lightning_eagle.data.vocab_map import VocabMapping
from lightning_eagle.features import format as fmt
from lightning_eagle.settings import check_settings


class FeatureRows(torch.utils.data.Dataset):
    """Rows ``[start, stop)`` of a dump, read lazily from the memory-mapped shards (one open handle per shard)."""

    def __init__(self, folder: Path, manifest: dict[str, Any], start: int, stop: int) -> None:
        self.folder, self.start, self.stop = folder, start, stop
        self.bounds = fmt.shard_bounds(manifest)  # shards of a row or token budget: sizes differ
        self.shards = [s["shard"] for s in manifest["shards"]]
        self._handles: dict[int, Any] = {}
        self._offsets: dict[int, torch.Tensor] = {}

    @override
    def __len__(self) -> int:
        return self.stop - self.start

    def __getstate__(self):  # loader workers open their own handles
        return {**self.__dict__, "_handles": {}, "_offsets": {}}

    def _shard(self, k: int):
        if k not in self._handles:
            self._handles[k] = safe_open(str(self.folder / self.shards[k]), framework="pt")
            self._offsets[k] = self._handles[k].get_tensor("offsets")
        return self._handles[k], self._offsets[k]

    def _locate(self, row: int) -> tuple[int, int]:
        """``(shard, index in it)`` of global row ``row``."""
        k = bisect.bisect_right(self.bounds, row) - 1
        return k, row - self.bounds[k]

    def lengths(self) -> torch.Tensor:
        """Token count of every row ``[start, stop)``, from the shards' ``offsets`` (what length bucketing sorts by)."""
        if self.stop <= self.start:
            return torch.zeros(0, dtype=torch.int64)
        (first, begin), (last, _) = self._locate(self.start), self._locate(self.stop - 1)
        parts = [torch.diff(self._shard(k)[1]) for k in range(first, last + 1)]
        return torch.cat(parts)[begin : begin + len(self)]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        shard, j = self._locate(self.start + i)
        handle, offsets = self._shard(shard)
        a, b = int(offsets[j]), int(offsets[j + 1])
        item = {name: handle.get_slice(name)[a:b] for name in ("aux_hidden_states", "hidden_states")}
        item["input_ids"] = handle.get_slice("input_ids")[a:b].long()
        item["loss_mask"] = handle.get_slice("loss_mask")[a:b].long()
        return item


class _FeatureCollate:
    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = collate_chat_rows(rows, self.pad_token_id)
        length = batch["input_ids"].shape[1]
        for name in ("aux_hidden_states", "hidden_states"):
            first = rows[0][name]
            if len(rows) == 1:  # nothing to pad: a 64K-token row of K3 states is 3.8 GB (bf16), never copied here
                batch[name] = first[None]
                continue
            out = first.new_zeros((len(rows), length, first.shape[-1]))  # padded positions are masked out
            for i, r in enumerate(rows):
                out[i, : r[name].shape[0]] = r[name]
            batch[name] = out
        return batch


class HiddenStateDataModule(ResumableTrainLoader, pl.LightningDataModule):
    """Dumped features → batches with ``input_ids``, ``attention_mask``, ``loss_mask`` (as ``ChatDataModule``),
    ``aux_hidden_states [B,T,3H]`` and ``hidden_states [B,T,H]`` (pre- or post-norm, see ``manifest``).

    The vocabulary map is the one the dump recorded, and rows ``[0, train)`` / ``[train, train+val)`` are the online
    run's training / validation split; the training order is shuffled by ``seed`` (default: the dump's data seed,
    i.e. the online run's order). A checkpoint records which features it was trained on and is refused on others.

    Args:
        features_dir: folder written by ``cli.py dump`` (must hold ``manifest.json``: a finished dump).
        batch_size: rows per batch. seed / shuffle: training order. loader_workers: ``DataLoader`` workers.
        verify: every shard is checked against the manifest when the data module is built: ``"checksum"`` (sha256,
            reads the whole dump once) or ``"size"`` (against its header only, for dumps too large to hash).
        bucket_batches: length bucketing, as ``ChatDataModule``'s (the same value, batch size and seed give the
            online run's batches).
    """

    def __init__(
        self,
        features_dir: str = "runs/quickstart/features",
        batch_size: int = 8,
        seed: int | None = None,
        shuffle: bool = True,
        loader_workers: int = 0,
        verify: Literal["checksum", "size"] = "checksum",
        bucket_batches: int | None = None,
    ) -> None:
        super().__init__()
        check_settings("data", {
            "batch_size": (batch_size, "positive", int), "loader_workers": (loader_workers, "non_negative", int),
            **({} if seed is None else {"seed": (seed, "non_negative", int)}),
            **({} if bucket_batches is None else {"bucket_batches": (bucket_batches, "positive", int)}),
        })  # fmt: skip
        self.bucket_batches = None if bucket_batches is None else int(bucket_batches)
        self.folder = Path(features_dir).expanduser()
        manifest_path = self.folder / fmt.MANIFEST_NAME
        if not manifest_path.is_file():
            what = "does not exist" if not self.folder.exists() else f"has no {fmt.MANIFEST_NAME} (an unfinished dump?)"
            raise FileNotFoundError(
                f"features folder {str(self.folder)!r} {what}; write it with `python cli.py dump --config …` "
                "(a killed dump resumes when run again)"
            )
        manifest = fmt.read_json(manifest_path)
        if manifest.get("format") != fmt.FORMAT:
            raise ValueError(f"{manifest_path}: format {manifest.get('format')!r}, expected {fmt.FORMAT!r}")
        self.manifest = {**manifest, "folder": str(self.folder)}
        if verify not in ("checksum", "size"):
            raise ValueError(f"data.verify must be 'checksum' or 'size', got {verify!r}")
        for shard in manifest["shards"]:
            if not (self.folder / shard["shard"]).is_file():
                raise FileNotFoundError(f"{self.folder}: {shard['shard']} listed in the manifest is missing")
            # a damaged shard trains on garbage (NaN losses, exit 0): refused here, by name, before any step
            problem = fmt.shard_problem(self.folder / shard["shard"], shard, checksum=verify == "checksum")
            if problem:
                raise ValueError(
                    f"{self.folder / shard['shard']}: {problem}; re-run the dump (or restore the file); "
                    "data.verify: size skips the checksum of large dumps"
                )
        self.batch_size, self.shuffle, self.loader_workers = batch_size, shuffle, loader_workers
        self.seed = manifest["data"]["seed"] if seed is None else seed
        self.vocab_mapping = VocabMapping.load(
            self.folder / fmt.VOCAB_MAP_NAME, expected_fingerprint=manifest["vocab_map"]["fingerprint"]
        )
        identity = {k: manifest.get(k) for k in fmt.IDENTITY_FIELDS}
        self.fingerprint = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
        self.train_dataset: FeatureRows | None = None
        self.val_dataset: FeatureRows | None = None

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    @property
    def pad_token_id(self) -> int:
        return int(self.manifest["pad_token_id"])

    def held_out_prompts(self, max_prompts: int | None = None) -> list[list[int]]:
        """The prompts the online run decodes for ``val/tau_real`` (rendered from the held-out chats at dump time)."""
        path = self.folder / fmt.PROMPTS_NAME
        prompts = fmt.read_json(path)["prompts"] if path.is_file() else []
        return prompts if max_prompts is None else prompts[:max_prompts]

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        n_train, n_val = self.manifest["rows"]["train"], self.manifest["rows"]["val"]
        self.train_dataset = FeatureRows(self.folder, self.manifest, 0, n_train)
        self.val_dataset = FeatureRows(self.folder, self.manifest, n_train, n_train + n_val) if n_val else None

    @override
    def train_dataloader(self) -> ResumableDataLoader:
        return self.resumable_train_loader(
            self.train_dataset, batch_size=self.batch_size, seed=self.seed, shuffle=self.shuffle,
            bucket_batches=self.bucket_batches, collate_fn=_FeatureCollate(self.pad_token_id),
            num_workers=self.loader_workers, persistent_workers=self.loader_workers > 0,
        )  # fmt: skip

    @override
    def val_dataloader(self) -> DataLoader | list:
        if self.val_dataset is None:
            return []
        return DataLoader(self.val_dataset, batch_size=self.batch_size, shuffle=False,
                          collate_fn=_FeatureCollate(self.pad_token_id), num_workers=self.loader_workers)  # fmt: skip

    @override
    def test_dataloader(self) -> DataLoader | list:
        return self.val_dataloader()

    predict_dataloader = test_dataloader

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"features": self.fingerprint, "seed": self.seed, "train_position": self.train_position()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Refuse a checkpoint trained on other features; resume its position."""
        theirs = state_dict.get("features")
        if theirs is not None and theirs != self.fingerprint:
            raise ValueError(
                f"the checkpoint was trained on other features (fingerprint {theirs}) than {self.folder} "
                f"({self.fingerprint}): another target, taps, dtype, data or vocabulary map"
            )
        if state_dict.get("seed") is not None and state_dict["seed"] != self.seed:
            raise ValueError(f"checkpoint was trained with data seed {state_dict['seed']}, this run uses {self.seed}")
        self.restore_train_position(state_dict.get("train_position"))
