"""The producer of engine features (``cli.py extract``): the run's chats rendered and masked by its data module, the
token ids sent to a vLLM engine that captures the taps and the final hidden (``extract_hidden_states``), and what it
writes stored in our features format, so ``HiddenStateDataModule`` trains either family from it unchanged.

1. **Before any engine starts**: the taps are converted to the engine's ids (:mod:`.engine_ids`: one place, with the
   K3 stream rules), the rows are numbered and cut into shards (:mod:`.plan`, as ``cli.py dump``), a folder holding
   other features is refused, and the disk estimate is printed and checked.
2. **Resumable**: shards already complete (checksum verified) or consumed and removed by a streaming fit are skipped;
   an engine of another version than the one that wrote them is refused.
3. **Order**: the shards holding validation rows first, then the training shards in order: a streaming fit reads
   the training rows shard by shard and validates from the start. ``max_ahead`` bounds the disk a streaming run holds.
4. **Per row**: the engine's file is checked (token ids equal the row's, shape, finite values), its columns are put
   in the draft's tap order and the file removed; a shard is written atomically with its sidecar, then
   ``producer.json``'s heartbeat and counts are updated. ``manifest.json`` is written once every shard is there.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from lightning_eagle.dtypes import DTYPES
from lightning_eagle.features import format as fmt
from lightning_eagle.features import plan as features
from lightning_eagle.features import progress
from lightning_eagle.features.engine_client import FeatureEngine
from lightning_eagle.features.engine_ids import EngineCapture, check_engine_env, engine_capture
from lightning_eagle.k3.target_spec import TargetSpec

EngineFactory = Callable[[EngineCapture], FeatureEngine]
PLAN_FIELDS = ("shard_rows", "shard_tokens", "rows", "engine")


def shard_order(made: features.FeaturesPlan) -> list[int]:
    """Shards holding validation rows first, then the rest in order."""
    train = made.plan["rows"]["train"]
    val = [k for k in range(made.num_shards) if made.bounds[k + 1] > train]
    return val + [k for k in range(made.num_shards) if k not in val]


def shard_done(folder: Path, k: int, rows: int, verify: bool = True) -> dict[str, Any] | None:
    """Shard ``k``'s sidecar when it is complete, or removed after a streaming fit trained on it."""
    sidecar = folder / fmt.shard_name(k).replace(".safetensors", ".json")
    info = progress.read_progress(sidecar)
    if info is not None and info.get("removed") and info.get("rows") == rows:
        return info
    return fmt.complete_shard(folder, k, rows, verify=verify)


def _staging_bytes(made: features.FeaturesPlan, capture: EngineCapture, concurrency: int, engine_dtype: str) -> int:
    longest = max(made.lengths, default=0)
    return concurrency * longest * len(capture.ids) * made.plan["hidden_size"] * DTYPES[engine_dtype].itemsize


class Producer:
    """One extraction into ``out_dir``: built (and everything checked) without an engine, then :meth:`run`."""

    def __init__(self, spec: TargetSpec, data, out_dir: Path, *, dtype: str = "bfloat16", shard_rows: int = 256,
                 shard_tokens: int | None = None, concurrency: int = 8, max_ahead: int | None = None,
                 engine_dtype: str = "bfloat16", final_id_is_output: bool = False, wait_interval: float = 2.0,
                 log: Callable[[str], None] | None = None) -> None:  # fmt: skip
        for name, value in (("concurrency", concurrency), ("shard_rows", shard_rows), ("max_ahead", max_ahead),
                            ("shard_tokens", shard_tokens)):  # fmt: skip
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"extract --{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if dtype not in DTYPES:
            raise ValueError(f"extract --dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.spec, self.data, self.out_dir = spec, data, Path(out_dir)
        self.dtype, self.concurrency, self.max_ahead = dtype, concurrency, max_ahead
        self.engine_dtype, self.wait_interval = engine_dtype, wait_interval
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.capture = engine_capture(spec, final_id_is_output)  # the K3 rules: before anything runs
        features.refuse_foreign_files(self.out_dir, "extract", "--out")
        data.prepare_data()
        self.made = features.features_plan(spec, data, dtype=dtype, hidden_kind="prenorm", shard_rows=shard_rows,
                                           shard_tokens=shard_tokens)  # fmt: skip
        self.plan = {**self.made.plan, "engine": {"name": "vllm", **self.capture.record()},
                     "shard_bounds": self.made.bounds}  # fmt: skip
        if (self.out_dir / fmt.PLAN_NAME).is_file():
            features.check_same_plan(self.out_dir, self.plan, PLAN_FIELDS)
        self.pending = [k for k in shard_order(self.made) if not self._done(k)]
        self.check_disk()

    written: dict[str, float] | None = (
        None  # after run(): tokens written and the seconds it took (engine start excluded)
    )

    def _done(self, k: int) -> dict[str, Any] | None:
        return shard_done(self.out_dir, k, len(self.made.shard_rows(k)))

    def check_disk(self) -> None:
        plan = self.plan
        need = sum(self.made.shard_tokens(k) for k in self.pending) * plan["bytes_per_token"]
        staging = _staging_bytes(self.made, self.capture, self.concurrency, self.engine_dtype)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.out_dir).free
        self.log(
            f"extract: {plan['tokens']} tokens in {len(self.made.rows)} rows, {plan['bytes_per_token']} bytes/token "
            f"({self.dtype}) = {plan['tokens'] * plan['bytes_per_token'] / 1e9:.3f} GB in all; "
            f"{len(self.pending)} of {self.made.num_shards} shards to write = {need / 1e9:.3f} GB, plus up to "
            f"{staging / 1e9:.3f} GB of engine files in flight ({self.concurrency} rows x "
            f"{len(self.capture.ids)} ids); "
            f"{free / 1e9:.1f} GB free at {self.out_dir}; engine ids {list(self.capture.ids)} "
            f"(taps {list(self.spec.aux_layer_ids)} + final {self.spec.num_layers})"
            + "".join(f", {k}={v}" for k, v in self.capture.env.items())
        )
        if need + staging > free:
            raise OSError(
                f"not enough disk space for the extraction in {self.out_dir}: {(need + staging) / 1e9:.3f} GB needed, "
                f"{free / 1e9:.3f} GB free"
            )

    def run(self, open_engine: EngineFactory, progress_bar: bool = True) -> Path:
        """Start the engine (``open_engine(capture)``), write every pending shard, then the manifest."""
        features.start_folder(self.out_dir, self.plan, self.data)
        with progress.ProducerHeartbeat(self.out_dir, self.made.num_shards) as beat:
            beat.update(shards_done=self.made.num_shards - len(self.pending))
            if self.pending:
                with open_engine(self.capture) as engine:
                    check_engine_env(self.capture, engine.env, engine.where)
                    self._check_version(engine)
                    beat.update(engine=engine.where, vllm=engine.version)
                    self._produce(engine, beat, progress_bar)
            manifest = self._manifest()
        self.log(f"extract complete: {manifest['tokens']} tokens in {len(manifest['shards'])} shards at {self.out_dir}")
        return self.out_dir

    def _check_version(self, engine: FeatureEngine) -> None:
        for k in range(self.made.num_shards):
            info = self._done(k)
            theirs = None if info is None else info.get("engine_version")
            if theirs is not None and theirs != engine.version:
                raise ValueError(
                    f"{self.out_dir / fmt.shard_name(k)} was extracted by vLLM {theirs}, this engine is vLLM "
                    f"{engine.version}: features of two engine versions are not mixed; resume with vLLM {theirs} or "
                    "pass another --out"
                )

    def _produce(self, engine: FeatureEngine, beat: progress.ProducerHeartbeat, progress_bar: bool) -> None:
        from tqdm import tqdm

        tokens = sum(self.made.shard_tokens(k) for k in self.pending)
        bar = tqdm(total=tokens, unit="tok", unit_scale=True, desc="extract", disable=not progress_bar)
        started, done = time.perf_counter(), self.made.num_shards - len(self.pending)
        with bar:
            for k in self.pending:
                self._wait_for_room(k)
                info = self._shard(engine, k, bar)
                done += 1
                beat.update(shards_done=done, tokens_per_s=bar.n / max(time.perf_counter() - started, 1e-9))
                self.log(f"extract: {info['shard']} ({info['rows']} rows, {info['tokens']} tokens) [{done}/"
                         f"{self.made.num_shards}]")  # fmt: skip
        seconds = time.perf_counter() - started
        self.written = {"tokens": tokens, "seconds": seconds}
        self.log(f"extract: {tokens} tokens in {seconds:.1f} s = {tokens / max(seconds, 1e-9):.0f} tokens/s")

    def _wait_for_room(self, k: int) -> None:
        """With ``max_ahead``: wait while that many training shards are written and not yet trained past."""
        if self.max_ahead is None or self.made.bounds[k] >= self.plan["rows"]["train"]:
            return
        last_said = 0.0
        while True:
            consumed = progress.consumed_rows(self.out_dir)
            ahead = [j for j in range(k) if self.made.bounds[j + 1] > consumed and self._done_quick(j)]
            if len(ahead) < self.max_ahead:
                return
            if time.monotonic() - last_said > 30:
                self.log(f"extract: waiting before shard {k}: {len(ahead)} shards written and not yet trained past "
                         f"(--max-ahead {self.max_ahead}; the fit has passed {consumed} training rows)")  # fmt: skip
                last_said = time.monotonic()
            time.sleep(self.wait_interval)

    def _done_quick(self, j: int) -> bool:
        return shard_done(self.out_dir, j, len(self.made.shard_rows(j)), verify=False) is not None

    def _shard(self, engine: FeatureEngine, k: int, bar) -> dict[str, Any]:
        rows = self.made.shard_rows(k)
        buffer = fmt.ShardBuffer(rows, [self.made.lengths[r] for r in rows], DTYPES[self.dtype])
        for start in range(0, len(rows), self.concurrency):
            chunk = rows[start : start + self.concurrency]
            items = [self.made.rows[r] for r in chunk]
            paths = engine.capture([item["input_ids"].tolist() for item in items])
            for row, item, path in zip(chunk, items, paths):
                aux, final = self._read(path, row, item["input_ids"])
                buffer.put(row, item["input_ids"], item["loss_mask"], aux, final)
                engine.release(path)
                bar.update(item["input_ids"].numel())
        info = fmt.write_shard(self.out_dir, k, buffer, DTYPES[self.dtype], extra={"engine_version": engine.version})
        return info

    def _read(self, path: Path, row: int, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The row's taps ``[T, n·H]`` (the draft's tap order) and pre-norm final hidden ``[T, H]`` from the engine's
        file, checked against what was asked."""
        try:
            tensors = load_file(str(path))
        except Exception as err:  # a truncated or foreign file
            raise ValueError(f"{path} (row {row}): not a readable hidden-states file ({err})") from None
        states, tokens = tensors.get("hidden_states"), tensors.get("token_ids")
        T, H, n = input_ids.numel(), self.plan["hidden_size"], len(self.capture.ids)
        if states is None or tokens is None:
            raise ValueError(f"{path} (row {row}): holds {sorted(tensors)}, expected hidden_states and token_ids")
        if not torch.equal(tokens.long().reshape(-1)[:T], input_ids.long()) or tokens.numel() < T:
            raise ValueError(f"{path} (row {row}): the engine's token_ids differ from the row's {T} tokens")
        if tuple(states.shape[1:]) != (n, H) or states.shape[0] < T:
            raise ValueError(
                f"{path} (row {row}): hidden_states has shape {tuple(states.shape)}, expected [{T}, {n}, {H}] "
                f"(ids {list(self.capture.ids)}): is the engine serving other ids or another model?"
            )
        states = states[:T]
        if not torch.isfinite(states).all():
            columns = (~torch.isfinite(states)).any(-1).any(0).nonzero()[:, 0].tolist()
            bad = sorted(self.capture.ids[c] for c in columns)
            raise ValueError(f"{path} (row {row}): the engine's states at ids {bad} are not finite")
        aux = states[:, list(self.capture.tap_columns)].reshape(T, -1)
        return aux, states[:, self.capture.final_column]

    def _manifest(self) -> dict[str, Any]:
        return features.write_manifest(
            self.out_dir, self.plan,
            lambda k: shard_done(self.out_dir, k, len(self.made.shard_rows(k)), verify=False), "extraction",
        )  # fmt: skip
