"""``HiddenStateDataModule``: batches of dumped target features (``cli.py dump``) for a draft-training module with
``model.target.source: features`` — the same rows, split, shuffle order, padding and resumable position as the
online run's ``ChatDataModule``, with ``aux_hidden_states`` and ``hidden_states`` added to each batch (no target
forward)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_eagle.data.dataset import collate_chat_rows
from lightning_eagle.data.sampler import ResumableDataLoader, ResumableTrainLoader
from lightning_eagle.data.vocab_map import VocabMapping
from lightning_eagle.features import format as fmt
from lightning_eagle.features.rows import FeatureRows
from lightning_eagle.features.streaming import StreamingFeatureRows, commit_consumed, train_segments, wait_for_plan
from lightning_eagle.settings import check_settings


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
        streaming: train while ``cli.py extract`` is still writing the folder (:mod:`.streaming`): the training rows
            are read shard by shard, each shard waited for and verified when first read.
        remove_consumed: (streaming, one epoch) delete each shard once saved checkpoints have passed it.
        producer_timeout: (streaming) seconds without a producer heartbeat after which a missing shard stops the fit.
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
        streaming: bool = False,
        remove_consumed: bool = False,
        producer_timeout: float = 600.0,
    ) -> None:
        super().__init__()
        check_settings("data", {
            "batch_size": (batch_size, "positive", int), "loader_workers": (loader_workers, "non_negative", int),
            **({} if seed is None else {"seed": (seed, "non_negative", int)}),
            **({} if bucket_batches is None else {"bucket_batches": (bucket_batches, "positive", int)}),
        })  # fmt: skip
        self.bucket_batches = None if bucket_batches is None else int(bucket_batches)
        self.folder = Path(features_dir).expanduser()
        self.streaming, self.remove_consumed, self.producer_timeout = streaming, remove_consumed, producer_timeout
        if verify not in ("checksum", "size"):
            raise ValueError(f"data.verify must be 'checksum' or 'size', got {verify!r}")
        self.verify = verify
        if streaming:
            manifest = self._streaming_plan(bucket_batches)
        else:
            if remove_consumed:
                raise ValueError("data.remove_consumed deletes shards a streaming fit trained past: set data.streaming")
            manifest = self._finished_manifest()
        self.manifest = {**manifest, "folder": str(self.folder)}
        self.batch_size, self.shuffle, self.loader_workers = batch_size, shuffle, loader_workers
        self.seed = manifest["data"]["seed"] if seed is None else seed
        self.vocab_mapping = VocabMapping.load(
            self.folder / fmt.VOCAB_MAP_NAME, expected_fingerprint=manifest["vocab_map"]["fingerprint"]
        )
        identity = {k: manifest.get(k) for k in fmt.IDENTITY_FIELDS}
        self.fingerprint = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
        self.train_dataset: FeatureRows | None = None
        self.val_dataset: FeatureRows | None = None

    def _finished_manifest(self) -> dict[str, Any]:
        """The manifest of a finished dump, every shard checked against it before any step."""
        manifest_path = self.folder / fmt.MANIFEST_NAME
        if not manifest_path.is_file():
            what = "does not exist" if not self.folder.exists() else f"has no {fmt.MANIFEST_NAME} (an unfinished dump?)"
            raise FileNotFoundError(
                f"features folder {str(self.folder)!r} {what}; write it with `python cli.py dump --config …` "
                "(a killed dump resumes when run again), or train while `cli.py extract` writes it with "
                "data.streaming: true"
            )
        manifest = fmt.read_json(manifest_path)
        self._check_format(manifest, manifest_path)
        for shard in manifest["shards"]:
            if shard.get("removed"):
                raise ValueError(
                    f"{self.folder / shard['shard']} was removed by a streaming fit that trained past it "
                    "(data.remove_consumed): this folder can no longer be read whole; extract again"
                )
            if not (self.folder / shard["shard"]).is_file():
                raise FileNotFoundError(f"{self.folder}: {shard['shard']} listed in the manifest is missing")
            # a damaged shard trains on garbage (NaN losses, exit 0): refused here, by name, before any step
            problem = fmt.shard_problem(self.folder / shard["shard"], shard, checksum=self.verify == "checksum")
            if problem:
                raise ValueError(
                    f"{self.folder / shard['shard']}: {problem}; re-run the dump (or restore the file); "
                    "data.verify: size skips the checksum of large dumps"
                )
        return manifest

    def _streaming_plan(self, bucket_batches: int | None) -> dict[str, Any]:
        if bucket_batches is not None:
            raise ValueError(
                "data.bucket_batches sorts rows by length across shards, data.streaming reads them shard by shard: "
                "drop one of them"
            )
        check_settings("data", {"producer_timeout": (self.producer_timeout, "positive", (int, float))})
        plan = wait_for_plan(self.folder, self.producer_timeout)
        self._check_format(plan, self.folder / fmt.PLAN_NAME)
        if "shard_bounds" not in plan:
            raise ValueError(
                f"{self.folder} was written by `cli.py dump`, which plans no streaming order: read it whole "
                "(data.streaming: false)"
            )
        return plan

    @staticmethod
    def _check_format(manifest: dict[str, Any], path: Path) -> None:
        if manifest.get("format") != fmt.FORMAT:
            raise ValueError(f"{path}: format {manifest.get('format')!r}, expected {fmt.FORMAT!r}")

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
        if self.streaming:

            def rows(start: int, stop: int) -> FeatureRows:
                return StreamingFeatureRows(self.folder, self.manifest, start, stop, verify=self.verify,
                                            producer_timeout=self.producer_timeout)  # fmt: skip

            self._refuse_many_epochs()
        else:

            def rows(start: int, stop: int) -> FeatureRows:
                return FeatureRows(self.folder, self.manifest, start, stop)

        self.train_dataset = rows(0, n_train)
        self.val_dataset = rows(n_train, n_train + n_val) if n_val else None

    def _refuse_many_epochs(self) -> None:
        trainer = getattr(self, "trainer", None)
        if not self.remove_consumed or trainer is None:
            return
        steps_per_epoch = -(-self.manifest["rows"]["train"] // (self.batch_size * max(trainer.world_size, 1)))
        steps = trainer.max_steps * trainer.accumulate_grad_batches
        one_epoch = trainer.max_epochs == 1 or 0 < steps <= steps_per_epoch
        if not one_epoch:
            raise ValueError(
                "data.remove_consumed deletes each shard once the fit trained past it, so the run must stay within one "
                f"epoch ({steps_per_epoch} steps of these features): set trainer.max_epochs: 1 or a trainer.max_steps "
                "within it"
            )

    @override
    def train_dataloader(self) -> ResumableDataLoader:
        return self.resumable_train_loader(
            self.train_dataset, batch_size=self.batch_size, seed=self.seed, shuffle=self.shuffle,
            bucket_batches=self.bucket_batches, collate_fn=_FeatureCollate(self.pad_token_id),
            segments=train_segments(self.manifest) if self.streaming else None,
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
        """Called as a checkpoint is saved. Streaming: the previous checkpoint is on disk by now, so the rows it
        passed are committed (``consumer.json``; with ``remove_consumed`` their shards removed)."""
        position = self.train_position()
        if self.streaming:
            self._commit(self._last_saved)
            self._last_saved = position
        return {"features": self.fingerprint, "seed": self.seed, "train_position": position}

    _last_saved: dict[str, Any] | None = None

    def _commit(self, position: dict[str, Any] | None) -> None:
        trainer = getattr(self, "trainer", None)
        if position is None or (trainer is not None and not trainer.is_global_zero):
            return
        train = int(self.manifest["rows"]["train"])
        rows = train if int(position.get("epoch", 0)) > 0 else min(int(position.get("consumed", 0)), train)
        commit_consumed(self.folder, self.manifest, rows, self.remove_consumed)

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
        if self.streaming:  # the checkpoint being resumed is saved: what it passed is committed
            self._commit(state_dict.get("train_position"))
