"""Dump the frozen target's features (taps, final hidden) once (``python cli.py dump --config …``), as ``predict``:

1. **Plan**: every row of the data module — its training split in order, then its validation rows — is numbered;
   shards hold consecutive rows, at most ``shard_rows`` (R) of them and, with ``shard_tokens``, at most that many
   tokens (:func:`~lightning_eagle.features.format.plan_shard_bounds`; a shard is held in host memory until
   written). ``plan.json`` records what is dumped (target fingerprint, taps, data and vocab-map fingerprints, dtype,
   pre/post-norm); a folder holding another plan is refused.
2. **Resume**: shards with a verified checksum are skipped; rank ``r`` of ``W`` dumps the missing shards
   ``k ≡ r (mod W)``. Ranks run the same number of forwards (padding batches, never written), because under
   expert parallelism every forward is collective.
3. **Disk**: the estimate (tokens × bytes per token) is printed and the run is refused if the filesystem lacks it.
4. **Forward**: :class:`FeatureDumper` (``predict_step``) captures the aux taps and the final hidden (pre- or
   post-norm) with autocast off, optionally through the token-chunked target forward (``target_token_chunk``: memory
   linear in T, the same features); a shard's rows are batched longest first, so a batch pads its rows only to
   lengths that are close. :class:`FeatureShardWriter` copies each row into its shard's buffer (allocated once, in the
   storage dtype: the host holds exactly the shard's bytes) and writes the shard atomically, then its sidecar.
5. **Manifest**: rank 0 writes ``manifest.json`` (plan + shards + totals) once every shard is complete.
"""

from __future__ import annotations

import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from lightning_eagle.atomic import check_writable, remove_partials
from lightning_eagle.data.dataset import collate_chat_rows
from lightning_eagle.features import format as fmt
from lightning_eagle.features import plan as features
from lightning_eagle.k3.model import set_token_chunk
from lightning_eagle.k3.target_spec import TargetSpec
from lightning_eagle.parallel.frozen_target import load_frozen_target
from lightning_eagle.settings import check_settings


class _RankSampler(DistributedSampler):
    """Yields ``0..n-1``: the dataset is already this rank's list of batches (Lightning must not re-shard it)."""

    def __init__(self, n: int) -> None:  # no super().__init__: it would query torch.distributed
        self.n = n

    @override
    def __iter__(self):
        return iter(range(self.n))

    @override
    def __len__(self) -> int:
        return self.n


class _Batches(torch.utils.data.Dataset):
    """This rank's batches: ``(shard, row_ids)`` or ``(None, row_ids)`` for a padding batch that is not written."""

    def __init__(self, rows: features.PlanRows, plan: list[tuple[int | None, list[int]]], pad_id: int):
        self.rows, self.plan, self.pad_id = rows, plan, pad_id

    @override
    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, i: int) -> dict[str, Any]:
        shard, row_ids = self.plan[i]
        batch = collate_chat_rows([self.rows[r] for r in row_ids], self.pad_id)
        return {**batch, "shard": -1 if shard is None else shard, "row_ids": torch.tensor(row_ids)}


class FeatureDumper(pl.LightningModule):
    """The frozen target (any supported layout) whose ``predict_step`` returns each row's features, unpadded.

    Built from the run's :class:`~lightning_eagle.k3.target_spec.TargetSpec` (a draft-training module's ``target_spec``:
    its checkpoint, taps, stream and dtypes) and the data module whose rows are dumped. ``shard_rows`` /
    ``shard_tokens``: a shard's row / token budget (None: rows only). ``target_token_chunk``: the target forward in
    token segments of this many tokens (as the module's ``model.target.token_chunk``; None: unchunked).
    """

    def __init__(
        self,
        target_spec: TargetSpec,
        datamodule,
        out_dir: Path,
        *,
        dtype: str,
        hidden_states: str,
        shard_rows: int,
        shard_tokens: int | None = None,
        target_token_chunk: int | None = None,
    ):
        super().__init__()
        if hidden_states not in fmt.HIDDEN_KINDS:
            raise ValueError(f"hidden_states must be one of {fmt.HIDDEN_KINDS}, got {hidden_states!r}")
        if dtype not in fmt.DTYPES:
            raise ValueError(f"dump dtype must be one of {sorted(fmt.DTYPES)}, got {dtype!r}")
        # target_token_chunk is model.target.token_chunk, checked where it is made (and by the model it is set on)
        check_settings("dump", {
            "shard_rows": (shard_rows, "positive", int),
            **({"shard_tokens": (shard_tokens, "positive", int)} if shard_tokens is not None else {}),
        })  # fmt: skip
        self.target_spec = target_spec
        self.data, self.out_dir = datamodule, Path(out_dir)
        self.dtype_name, self.hidden_kind, self.shard_rows = dtype, hidden_states, int(shard_rows)
        self.shard_tokens = None if shard_tokens is None else int(shard_tokens)
        self.target_token_chunk = target_token_chunk
        self.target = None
        self.rows = features.PlanRows(None, None)
        self.row_lengths: list[int] = []
        self.bounds: list[int] = [0, 0]  # shard k holds rows [bounds[k], bounds[k+1])
        self.plan: dict[str, Any] = {}
        self.written_names: set[str] = set()  # shards this process wrote (the writer adds them)

    # ---- what to dump -------------------------------------------------------------------------------------------
    @override
    def setup(self, stage: str) -> None:
        """Number the rows, write (rank 0) or check ``plan.json`` and ``vocab_map.safetensors``."""
        strategy = self.trainer.strategy
        features.refuse_foreign_files(self.out_dir, "dump", "--out")
        if self.trainer.is_global_zero:
            check_writable(self.out_dir, "the features folder (dump --out)")
            self.out_dir.mkdir(parents=True, exist_ok=True)
            remove_partials(self.out_dir)  # a killed dump's half-written files
            self.data.prepare_data()  # tokenize once into the cache
        strategy.barrier("dump-prepare")
        made = features.features_plan(self.target_spec, self.data, dtype=self.dtype_name,
                                      hidden_kind=self.hidden_kind, shard_rows=self.shard_rows,
                                      shard_tokens=self.shard_tokens)  # fmt: skip
        self.plan, self.rows, self.row_lengths, self.bounds = made.plan, made.rows, made.lengths, made.bounds
        if self.trainer.is_global_zero:
            features.start_folder(self.out_dir, self.plan, self.data)
        strategy.barrier("dump-plan")
        features.check_same_plan(self.out_dir, self.plan, ("shard_rows", "shard_tokens", "rows"))

    def shard_rows_of(self, shard: int) -> list[int]:
        return list(range(self.bounds[shard], self.bounds[shard + 1]))

    def shard_batches(self, shard: int) -> list[list[int]]:
        """The batches of shard ``shard``: its rows longest first (stable), ``batch_size`` at a time, so a short row is
        never padded to a long one's length (a dump of mixed 1K-64K rows would otherwise run mostly padding)."""
        rows = sorted(self.shard_rows_of(shard), key=lambda r: -self.row_lengths[r])
        return _chunks(rows, self.data.batch_size)

    def pending_shards(self) -> list[int]:
        """This rank's shards without a complete, checksum-verified file."""
        rank, world = self.trainer.global_rank, self.trainer.world_size
        return [
            k
            for k in range(rank, self.plan["num_shards"], world)
            if fmt.complete_shard(self.out_dir, k, len(self.shard_rows_of(k))) is None
        ]

    def check_disk(self, pending: list[int]) -> None:
        shard_tokens = [sum(self.row_lengths[r] for r in self.shard_rows_of(k)) for k in pending]
        need = sum(shard_tokens) * self.plan["bytes_per_token"]
        free = shutil.disk_usage(self.out_dir).free
        # a shard's rows are collected in host memory until it is written: --shard-tokens bounds that for long rows
        largest = max(shard_tokens, default=0) * self.plan["bytes_per_token"]
        rank_zero_info(
            f"dump: {self.plan['tokens']} tokens in {len(self.rows)} rows, {self.plan['bytes_per_token']} bytes/token "
            f"({self.dtype_name}) = {self.plan['tokens'] * self.plan['bytes_per_token'] / 1e9:.3f} GB in all; "
            f"this rank writes {need / 1e9:.3f} GB to {self.out_dir} ({free / 1e9:.1f} GB free); its largest shard "
            f"is held in host memory until written: {largest / 1e9:.3f} GB (--shard-rows {self.shard_rows}, "
            f"--shard-tokens {self.shard_tokens})"
        )
        if need > free:
            raise OSError(
                f"not enough disk space for the dump in {self.out_dir}: {need / 1e9:.3f} GB needed, "
                f"{free / 1e9:.3f} GB free"
            )

    @override
    def predict_dataloader(self) -> DataLoader:
        pending = self.pending_shards()
        self.check_disk(pending)
        plan = [(k, chunk) for k in pending for chunk in self.shard_batches(k)]
        count = torch.tensor(len(plan))
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(count, op=dist.ReduceOp.MAX)  # every rank runs as many (collective) forwards
        padding = plan[-1][1] if plan else [0]
        plan += [(None, padding)] * (int(count) - len(plan))
        return DataLoader(_Batches(self.rows, plan, self.data.pad_token_id), batch_size=None,
                          sampler=_RankSampler(len(plan)))  # fmt: skip

    # ---- the forward ---------------------------------------------------------------------------------------------
    @override
    def configure_model(self) -> None:
        if self.target is None:
            self.target = set_token_chunk(load_frozen_target(self, self.target_spec), self.target_token_chunk)

    @override
    def on_predict_start(self) -> None:
        self._started = time.perf_counter()

    @override
    def on_predict_end(self) -> None:
        self.trainer.strategy.barrier("dump-shards")
        if self.trainer.is_global_zero:
            manifest = write_manifest(self)
            seconds = time.perf_counter() - self._started
            written = sum(s["tokens"] for s in manifest["shards"] if s["shard"] in self.written_names)
            rank_zero_info(
                f"dump complete: {self.plan['rows']['train']} train + {self.plan['rows']['val']} val rows, "
                f"{self.plan['tokens']} tokens in {len(manifest['shards'])} shards at {self.out_dir} "
                f"(this run wrote {written} tokens in {seconds:.1f} s on rank 0: {written / max(seconds, 1e-9):.0f} "
                "tokens/s per rank)"
            )
        self.trainer.strategy.barrier("dump-manifest")

    @torch.no_grad()
    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any] | None:
        prenorm, spec = self.hidden_kind == "prenorm", self.target_spec
        with torch.autocast(device_type=self.device.type, enabled=False):
            cap = self.target.capture(batch["input_ids"], batch["attention_mask"], return_prenorm=prenorm,
                                      aux_layer_ids=list(spec.aux_layer_ids), aux_stream=spec.aux_stream)  # fmt: skip
        if int(batch["shard"]) < 0:
            return None
        aux, final = cap.aux_hidden_states, cap.final_prenorm if prenorm else cap.final_hidden
        lengths = batch["attention_mask"].sum(-1).tolist()
        # views on the device: the writer copies each row (cast to the storage dtype) straight into its shard's buffer
        return {
            "shard": int(batch["shard"]),
            "row_ids": batch["row_ids"].tolist(),
            "rows": [
                (batch["input_ids"][i, :n], batch["loss_mask"][i, :n], aux[i, :n], final[i, :n])
                for i, n in enumerate(lengths)
            ],
        }


class FeatureShardWriter(BasePredictionWriter):
    """Copies the rows of each shard from ``predict_step`` into the shard's buffer
    (:class:`~lightning_eagle.features.format.ShardBuffer`: row order whatever order the batches came in) and writes
    the shard once it has all of them."""

    def __init__(self, dumper: FeatureDumper) -> None:
        super().__init__(write_interval="batch")
        self.dumper = dumper
        self.pending: dict[int, fmt.ShardBuffer] = {}

    @override
    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx=0):
        if prediction is None:
            return
        shard, dumper = prediction["shard"], self.dumper
        if shard not in self.pending:
            rows = dumper.shard_rows_of(shard)
            lengths = [dumper.row_lengths[r] for r in rows]
            self.pending[shard] = fmt.ShardBuffer(rows, lengths, fmt.DTYPES[dumper.dtype_name])
        buffer = self.pending[shard]
        for row_id, row in zip(prediction["row_ids"], prediction["rows"]):
            buffer.put(row_id, *row)
        if buffer.complete:
            info = fmt.write_shard(dumper.out_dir, shard, self.pending.pop(shard), fmt.DTYPES[dumper.dtype_name])
            dumper.written_names.add(info["shard"])


def write_manifest(dumper: FeatureDumper) -> dict[str, Any]:
    """Rank 0, after every rank finished: the plan plus every shard's sidecar (all must be complete)."""
    return features.write_manifest(
        dumper.out_dir, dumper.plan,
        lambda k: fmt.complete_shard(dumper.out_dir, k, len(dumper.shard_rows_of(k)), verify=False), "dump",
    )  # fmt: skip


def _chunks(items: list[int], size: int) -> list[list[int]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def dump_features(target_spec: TargetSpec, datamodule, out_dir, trainer: pl.Trainer, *, dtype: str = "bfloat16",
                  hidden_states: str = "prenorm", shard_rows: int = 256, shard_tokens: int | None = None,
                  target_token_chunk: int | None = None) -> Path:  # fmt: skip
    """Dump ``datamodule``'s rows through the target ``target_spec`` names (e.g. a draft-training module's
    ``target_spec``) with ``trainer``'s layout; what ``cli.py dump`` runs. Returns the features folder
    (``manifest.json`` written).
    ``shard_rows`` / ``shard_tokens`` and ``target_token_chunk``: see :class:`FeatureDumper`."""
    if not isinstance(target_spec, TargetSpec):
        raise TypeError(f"dump_features takes a TargetSpec (e.g. module.target_spec), got {type(target_spec).__name__}")
    target_spec.require_k3("cli.py dump (our target's forward)")
    dumper = FeatureDumper(target_spec, datamodule, Path(out_dir), dtype=dtype, hidden_states=hidden_states,
                           shard_rows=shard_rows, shard_tokens=shard_tokens,
                           target_token_chunk=target_token_chunk)  # fmt: skip
    trainer.callbacks.append(FeatureShardWriter(dumper))
    with warnings.catch_warnings():  # our batches carry their own row ids; Lightning's index tracking does not apply
        warnings.filterwarnings("ignore", message="Couldn't infer the batch indices")
        trainer.predict(dumper, return_predictions=False)
    return Path(out_dir)
