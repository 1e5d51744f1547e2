"""``ChatDataModule``: chat files + a Kimi tokenizer -> masked, padded batches and the draft vocabulary map."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_eagle.data.dataset import TokenizedChatDataset, collate_chat_rows
from lightning_eagle.data.encoding import EncodeOptions
from lightning_eagle.data.formats import FORMATS
from lightning_eagle.data.loss_mask import (
    KIMI_K3_DEFAULTS,
    XTML_MARKERS,
    LossMaskRecovery,
    get_loss_mask_recovery,
    get_loss_mask_recovery_by_name,
)
from lightning_eagle.data.render_k3 import validate_render_options
from lightning_eagle.data.sampler import ResumableDataLoader, ResumableTrainLoader
from lightning_eagle.data.shared_files import refuse_shared_files
from lightning_eagle.data.synthetic_corpus import bundled_sample_path
from lightning_eagle.data.tokenizer import KimiTokenizer
from lightning_eagle.data.tokenizer_choice import resolve_tokenizer
from lightning_eagle.data.vocab_map import VocabMapping, build_vocab_mapping, vocab_map_fingerprint
from lightning_eagle.settings import check_settings

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    root = os.environ.get("LIGHTNING_EAGLE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lightning_eagle")
    return Path(root) / "chat_data"


class _Subset(torch.utils.data.Dataset):
    def __init__(self, dataset: TokenizedChatDataset, indices: list[int]) -> None:
        self.dataset, self.indices = dataset, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.dataset[self.indices[i]]

    def lengths(self) -> torch.Tensor:
        """Token count of every row, in subset order (what length bucketing sorts by)."""
        return self.dataset.lengths()[torch.as_tensor(self.indices, dtype=torch.long)]


class _Collate:
    """Picklable collate function (loader worker processes need to pickle it)."""

    def __init__(self, pad_token_id: int, pad_to: int | None) -> None:
        self.pad_token_id, self.pad_to = pad_token_id, pad_to

    def __call__(self, rows):
        return collate_chat_rows(rows, self.pad_token_id, self.pad_to)


class ChatDataModule(ResumableTrainLoader, pl.LightningDataModule):
    """Chat conversations (ShareGPT or OpenAI messages) or pre-tokenized rows, from JSON / JSONL (``.gz`` / ``.zst``)
    or Parquet files, globs or directories -> ``input_ids``, ``attention_mask``, ``loss_mask``.

    Rows are rendered in K3 XTML (generation prompt off), cut to ``max_length``, masked by the loss-mask recovery the
    tokenizer selects (``kimi_k3`` for K3), cached on disk, split deterministically into train/val and right-padded
    per batch. With no arguments it uses the bundled synthetic corpus and the synthetic K3 tokenizer (vocab 512).

    After ``setup()``: ``vocab_mapping`` (``d2t``, ``t2d``, ``selected``, built from the training split's supervised
    tokens), ``summary`` (row counts), ``train_dataset`` / ``val_dataset``. Available right after construction (for
    ``LightningCLI`` links): ``tokenizer``, ``vocab_size``, ``bos_token_id``, ``eos_token_id`` (K3's
    ``<|end_of_msg|>``, the id the K3 model config calls eos), ``pad_token_id``, ``draft_vocab_size``.

    Args:
        train_files: files, globs (``data/*.jsonl``) or directories of shards (every ``.jsonl``, ``.json``,
            ``.jsonl.gz``, ``.json.gz``, ``.jsonl.zst``, ``.json.zst`` and ``.parquet`` file inside, sorted); None =
            the bundled synthetic sample.
        val_files: explicit validation files (same forms); if None, ``val_fraction`` of the training rows is held out.
        format: how rows are read: ``"auto"`` (per file: ``conversations`` -> ShareGPT, ``messages`` -> OpenAI,
            ``input_ids`` -> pre-tokenized), or force ``"sharegpt"``, ``"openai"`` (chat messages; pre-tokenized rows
            may be mixed in) or ``"tokens"`` (pre-tokenized only). See :mod:`lightning_eagle.data.formats` for the
            role table.
        tokenizer: ``"synthetic"`` (golden K3 layout), ``"synthetic-k2"``, or a Kimi tokenizer directory (a
            ``KimiTokenizer`` object is accepted from Python).
        max_length: rows are right-cut to this many tokens before masking (cut rows are counted).
        batch_size: rows per batch.
        val_fraction: share of training rows held out when ``val_files`` is None (0 disables validation).
        seed: split and shuffle seed (shuffling depends only on seed and epoch).
        thinking / thinking_effort: K3 render options (reference defaults: on, ``"max"``); keep them equal to the
            serving configuration. ``thinking_effort=None`` omits the ~280-token effort note (byte tokenizer).
        loss_mask_recovery: force a registered recovery by name; None = detect from the tokenizer (raises if none).
        include_generation_scaffold / include_trailer / last_turn_only / drop_scaffold_only_tail: ``kimi_k3``
            options (`chat_and_loss_mask.md` §6.7); ignored names raise for other recoveries.
        draft_vocab_size: draft vocabulary size; None (or >= vocab) = identity map.
        on_bad_row: ``"raise"`` on the first malformed row (file:line: field: problem) or ``"skip"`` and count it.
        cache_dir: tokenized-data cache root (default ``$LIGHTNING_EAGLE_CACHE`` or ``~/.cache/lightning_eagle``);
            ``use_cache=False`` disables reading and writing it.
        tokenize_workers: processes for tokenization; None = automatic (in-process below 2000 rows). Rows are streamed
            to them in bounded chunks, each written to the cache as it completes (a killed run resumes).
        loader_workers: ``DataLoader`` worker processes.
        pad_to_max_length: pad every batch to ``max_length`` instead of its longest row.
        shuffle: shuffle training rows each epoch.
        bucket_batches: length bucketing of the training batches. None (default): batches of the epoch's shuffled
            order. ``m >= 1``: each window of ``m * batch_size`` rows of that order is sorted by length and cut into
            batches (their order shuffled within the window), so a batch is padded only to rows of similar length;
            still deterministic in ``(seed, epoch)``, every row once per epoch, resumable mid-epoch on any world size
            (:mod:`lightning_eagle.data.sampler`). Larger ``m``: less padding, batches less random. Validation
            batches keep the file order.
    """

    def __init__(
        self,
        train_files: list[str] | str | None = None,
        val_files: list[str] | str | None = None,
        format: Literal["auto", "sharegpt", "openai", "tokens"] = "auto",
        tokenizer: str = "synthetic",
        max_length: int = 4096,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        seed: int = 0,
        thinking: bool = True,
        thinking_effort: str | None = "max",
        loss_mask_recovery: str | None = None,
        include_generation_scaffold: bool = True,
        include_trailer: bool = False,
        last_turn_only: bool = False,
        drop_scaffold_only_tail: bool = True,
        draft_vocab_size: int | None = None,
        on_bad_row: Literal["raise", "skip"] = "raise",
        cache_dir: str | None = None,
        use_cache: bool = True,
        tokenize_workers: int | None = None,
        loader_workers: int = 0,
        pad_to_max_length: bool = False,
        shuffle: bool = True,
        bucket_batches: int | None = None,
    ) -> None:
        super().__init__()
        check_settings("data", {
            "batch_size": (batch_size, "positive", int), "val_fraction": (val_fraction, "fraction_below_one", float),
            "seed": (seed, "non_negative", int), "loader_workers": (loader_workers, "non_negative", int),
            **({} if tokenize_workers is None else {"tokenize_workers": (tokenize_workers, "positive", int)}),
            **({} if draft_vocab_size is None else {"draft_vocab_size": (draft_vocab_size, "positive", int)}),
            **({} if bucket_batches is None else {"bucket_batches": (bucket_batches, "positive", int)}),
            "max_length": (max_length, "positive", int),
        })  # fmt: skip
        if max_length < 2:
            raise ValueError(f"data.max_length must be at least 2, got {max_length}")
        if bucket_batches is not None and pad_to_max_length:
            raise ValueError(
                "data.bucket_batches groups rows of similar length so each batch is padded to its longest row, "
                "data.pad_to_max_length pads every batch to max_length: set one of them, got both"
            )
        if on_bad_row not in ("raise", "skip"):
            raise ValueError(f"on_bad_row must be 'raise' or 'skip', got {on_bad_row!r}")
        if format not in FORMATS:
            raise ValueError(f"format must be one of {list(FORMATS)}, got {format!r}")
        self.save_hyperparameters()
        self.train_files = _as_file_list(train_files) or [str(bundled_sample_path())]
        self.val_files = _as_file_list(val_files)
        self.batch_size, self.max_length, self.seed = batch_size, max_length, seed
        self.val_fraction, self.shuffle, self.pad_to_max_length = val_fraction, shuffle, pad_to_max_length
        self.on_bad_row, self.tokenize_workers, self.loader_workers = on_bad_row, tokenize_workers, loader_workers
        self.format, self.bucket_batches = format, None if bucket_batches is None else int(bucket_batches)
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self.use_cache = use_cache
        self.render_options = {"thinking": thinking, "thinking_effort": thinking_effort}
        validate_render_options(**self.render_options)

        self.tokenizer_setting = tokenizer  # as given: a name, a directory or a tokenizer object
        self.tokenizer: KimiTokenizer = resolve_tokenizer(tokenizer)
        self.recovery: LossMaskRecovery = self._select_recovery(loss_mask_recovery)
        mask_options = {
            "include_generation_scaffold": include_generation_scaffold,
            "include_trailer": include_trailer,
            "last_turn_only": last_turn_only,
            "drop_scaffold_only_tail": drop_scaffold_only_tail,
        }
        # Only pass what the chosen recovery understands; a non-default value it does not know is an error.
        supported = {k: v for k, v in mask_options.items() if k in self.recovery.defaults}
        unsupported = {
            k: v for k, v in mask_options.items() if k not in self.recovery.defaults and v != KIMI_K3_DEFAULTS[k]
        }
        if unsupported:
            raise ValueError(f"loss-mask recovery {self.recovery.name!r} does not support {sorted(unsupported)}")
        self.recovery_options = self.recovery.resolve_options(**supported)
        self.draft_vocab_size = draft_vocab_size

        self.train_dataset: torch.utils.data.Dataset | None = None
        self.val_dataset: torch.utils.data.Dataset | None = None
        self.vocab_mapping: VocabMapping | None = None
        self.summary: dict[str, Any] = {}
        self._train_data: TokenizedChatDataset | None = None

    # ------------------------------------------------------------------------------------------- linkable values

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def bos_token_id(self) -> int:
        return self.tokenizer.bos_token_id

    @property
    def eos_token_id(self) -> int:
        end_of_msg = self.tokenizer.end_of_msg_token_id
        return end_of_msg if end_of_msg is not None else self.tokenizer.eos_token_id

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.tokenizer.eos_token_id

    @property
    def forced_vocab_ids(self) -> list[int]:
        """Ids always kept in the draft vocabulary: bos/eos/pad/unk and the XTML markers."""
        tok = self.tokenizer
        ids = {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id, tok.end_of_msg_token_id}
        ids |= {tok.special_tokens[m] for m in XTML_MARKERS if m in tok.special_tokens}
        return sorted(i for i in ids if i is not None)

    # ------------------------------------------------------------------------------------------- hooks

    def _select_recovery(self, name: str | None) -> LossMaskRecovery:
        if name is not None:
            return get_loss_mask_recovery_by_name(name)
        recovery = get_loss_mask_recovery(self.tokenizer)
        if recovery is None:
            raise RuntimeError(
                f"no loss-mask recovery detects tokenizer {self.tokenizer!r}; a slow Kimi tokenizer needs one "
                "(never falling back to an all-zero or all-ones mask). Pass loss_mask_recovery=<name> or register one."
            )
        return recovery

    def _encode_options(self) -> EncodeOptions:
        return EncodeOptions(
            max_length=self.max_length,
            render_options=dict(self.render_options),
            recovery_name=self.recovery.name,
            recovery_options=dict(self.recovery_options),
            on_bad_row=self.on_bad_row,
            format=self.format,
        )

    def _load(self, files: list[str]) -> TokenizedChatDataset:
        return TokenizedChatDataset.build_or_load(
            files,
            self.tokenizer,
            self.recovery,
            self._encode_options(),
            cache_dir=self.cache_dir if self.use_cache else None,
            workers=self.tokenize_workers,
        )

    def prepare_data(self) -> None:
        """Tokenize and cache (rank 0 per node); ``setup`` then reads the cache."""
        if self.use_cache:
            self._load(self.train_files)
            if self.val_files:
                self._load(self.val_files)

    def setup(self, stage: str | None = None) -> None:
        if self._train_data is not None:
            return
        if self.val_files:
            refuse_shared_files(self.train_files, self.val_files)
        train = self._load(self.train_files)
        self._train_data = train
        train_idx, val_idx = self._split(len(train))
        if len(train_idx) == 0:
            files = ", ".join(str(f) for f in train.summary.files) or str(self.train_files)
            raise ValueError(f"no training rows left after filtering {files}: {train.summary.describe()}")
        self.train_dataset = _Subset(train, train_idx)
        if self.val_files:
            val = self._load(self.val_files)
            self.val_dataset = _Subset(val, list(range(len(val)))) if len(val) else None
            self.summary = {"train": train.summary.__dict__, "val": val.summary.__dict__}
        else:
            self.val_dataset = _Subset(train, val_idx) if val_idx else None
            self.summary = {"train": train.summary.__dict__}
        self.summary["split"] = {"train_rows": len(train_idx), "val_rows": len(self.val_dataset or [])}
        self.vocab_mapping = self._vocab_mapping(train, train_idx)

    def _split(self, n: int) -> tuple[list[int], list[int]]:
        if self.val_files or self.val_fraction == 0 or n < 2:
            return list(range(n)), []
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed)).tolist()
        n_val = min(n - 1, max(1, round(n * self.val_fraction)))
        return sorted(order[n_val:]), sorted(order[:n_val])

    def _vocab_mapping(self, data: TokenizedChatDataset, train_idx: list[int]) -> VocabMapping:
        V, N_d = self.vocab_size, self.draft_vocab_size
        fields = {
            "tokenizer": self.tokenizer.fingerprint,
            "dataset": data.key,
            "train_rows": _digest(train_idx),
            "recovery": self.recovery.name,
            "recovery_options": self.recovery_options,
            "target_vocab_size": V,
            "draft_vocab_size": N_d,
            "forced_ids": self.forced_vocab_ids,
        }
        fingerprint = vocab_map_fingerprint(fields)
        path = self.cache_dir / data.key / f"vocab_map_{N_d}_{fingerprint[:16]}.safetensors" if data.key else None
        if self.use_cache and path is not None and path.is_file():
            try:
                return VocabMapping.load(path, expected_fingerprint=fingerprint)
            except (ValueError, OSError, KeyError) as exc:
                log.warning("rebuilding vocab map: cached %s unusable (%s)", path, exc)
        mapping = build_vocab_mapping(
            (ids for ids, _ in data.rows(train_idx)),
            (mask for _, mask in data.rows(train_idx)),
            target_vocab_size=V,
            draft_vocab_size=N_d,
            forced_ids=self.forced_vocab_ids,
            fingerprint=fingerprint,
        )
        if self.use_cache and path is not None:
            mapping.save(path, fields)
        return mapping

    # ------------------------------------------------------------------------------------------- loaders

    def _collate(self) -> _Collate:
        return _Collate(self.pad_token_id, self.max_length if self.pad_to_max_length else None)

    def train_dataloader(self) -> ResumableDataLoader:
        """Shards itself over the trainer's data-parallel world and resumes mid-epoch from a checkpoint."""
        if self.train_dataset is None:
            raise RuntimeError("call setup() before train_dataloader()")
        return self.resumable_train_loader(
            self.train_dataset, batch_size=self.batch_size, seed=self.seed, shuffle=self.shuffle,
            bucket_batches=self.bucket_batches, collate_fn=self._collate(), num_workers=self.loader_workers,
            persistent_workers=self.loader_workers > 0,
        )  # fmt: skip

    def val_dataloader(self) -> DataLoader | list:
        if self.val_dataset is None:
            return []
        return DataLoader(
            self.val_dataset,
            batch_size=self.batch_size,
            shuffle=False,
            collate_fn=self._collate(),
            num_workers=self.loader_workers,
        )

    def test_dataloader(self) -> DataLoader | list:
        """``test`` and ``predict`` run on the held-out split (``val_files`` or the ``val_fraction`` rows)."""
        return self.val_dataloader()

    predict_dataloader = test_dataloader

    # ------------------------------------------------------------------------------------------- resume

    def state_dict(self) -> dict[str, Any]:
        """Identity of the data a checkpoint was trained on (seed, cache key, vocab map) and the position inside the
        epoch (the train loader's ``state_dict``).

        Lightning also saves the loader's state with its fit loop, but restores it only when the train loader is
        built after the checkpoint is loaded — not when ``configure_optimizers`` asks for
        ``trainer.estimated_stepping_batches`` (ours does), which builds it before. The data module's state is always
        restored, so the position is applied from here.
        """
        data = self._train_data
        return {
            "seed": self.seed,
            "dataset_key": data.key if data is not None else None,
            "vocab_map_fingerprint": self.vocab_mapping.fingerprint if self.vocab_mapping is not None else None,
            "train_position": self.train_position(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Refuse to resume with a different seed (split and shuffle order), data or vocab map; resume the position."""
        if state_dict.get("seed") is not None and state_dict["seed"] != self.seed:
            raise ValueError(
                f"checkpoint was trained with data seed {state_dict['seed']}, this data module uses {self.seed}: "
                "the train/val split and shuffle order would differ"
            )
        mine = self.state_dict()
        for key in ("dataset_key", "vocab_map_fingerprint"):
            theirs = state_dict.get(key)
            if theirs is not None and mine[key] is not None and theirs != mine[key]:
                raise ValueError(
                    f"checkpoint was trained with a different {key} ({theirs[:16]}…) than this data module "
                    f"({mine[key][:16]}…): the data, tokenizer or masking options changed"
                )
        self.restore_train_position(state_dict.get("train_position"))


def _as_file_list(files: list[str] | str | None) -> list[str]:
    if files is None:
        return []
    if isinstance(files, (str, os.PathLike)):
        return [str(files)]
    return [str(f) for f in files]


def _digest(indices: list[int]) -> str:
    return hashlib.sha256(json.dumps(indices).encode()).hexdigest()[:16]
