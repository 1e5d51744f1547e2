"""Draft vocabulary map ``d2t`` / ``t2d`` (`eagle3_training.md` §9).

The draft predicts over ``N_d`` of the target's ``V`` ids. We count the tokens the draft is actually asked to
predict - ``x[q+1]`` for every position ``q`` with ``loss_mask[q] == 1`` (the trainer's gate, §6.3) - force the
special/structural ids in, take the most frequent (ties -> lower id), fill with the lowest unused ids, and sort
ascending so that ``d2t`` order, ``t2d`` order and the teacher's column order agree.
Serving meaning: ``target_id = draft_id + d2t[draft_id]``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

VOCAB_MAP_FORMAT = "lightning_eagle.vocab_map/1"


def _rows(input_ids: Any) -> Iterable[torch.Tensor]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 1:
            return [input_ids]
        if input_ids.dim() == 2:
            return list(input_ids)
        raise ValueError(f"expected 1-D or 2-D ids, got shape {list(input_ids.shape)}")
    return (torch.as_tensor(row, dtype=torch.long) for row in input_ids)


def count_supervised_tokens(input_ids: Any, loss_mask: Any, vocab_size: int) -> torch.Tensor:
    """``[V]`` int64 counts of ``x[q+1]`` over positions with ``loss_mask[q] == 1`` (rows may differ in length).

    The last position of a row predicts a token that is not in the row, so it contributes nothing here.
    """
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for row, (ids, mask) in enumerate(zip(_rows(input_ids), _rows(loss_mask), strict=True)):
        ids, mask = ids.long(), mask.long()
        if ids.shape != mask.shape:
            raise ValueError(f"row {row}: input_ids length {ids.numel()} != loss_mask length {mask.numel()}")
        predicted = ids[1:][mask[:-1] == 1]
        if predicted.numel() and (predicted.min() < 0 or predicted.max() >= vocab_size):
            raise ValueError(f"row {row}: token id outside [0, {vocab_size}) among supervised tokens")
        counts += torch.bincount(predicted, minlength=vocab_size)
    return counts


def select_draft_tokens(counts: torch.Tensor, draft_vocab_size: int, forced_ids: Sequence[int] = ()) -> torch.Tensor:
    """Ascending ``[N_d]`` selected target ids: forced ids, then by descending count (ties -> lower id), then fill."""
    vocab_size = counts.numel()
    forced = sorted({int(i) for i in forced_ids})
    if any(not 0 <= i < vocab_size for i in forced):
        raise ValueError(f"forced ids must lie in [0, {vocab_size}), got {forced}")
    if len(forced) > draft_vocab_size:
        raise ValueError(f"{len(forced)} forced ids do not fit a draft vocabulary of {draft_vocab_size}")
    chosen = torch.zeros(vocab_size, dtype=torch.bool)
    chosen[forced] = True
    budget = draft_vocab_size - len(forced)
    # Stable sort of -count over ascending ids gives "descending count, ties to the lower id".
    order = torch.sort(-counts.long(), stable=True).indices
    frequent = order[(counts[order] > 0) & ~chosen[order]][:budget]
    chosen[frequent] = True
    missing = draft_vocab_size - int(chosen.sum())
    if missing > 0:
        chosen[torch.nonzero(~chosen).flatten()[:missing]] = True
    return torch.nonzero(chosen).flatten()


@dataclass(frozen=True)
class VocabMapping:
    """``selected`` [N_d] ascending target ids, ``d2t = selected - arange`` (int64), ``t2d`` [V] bool."""

    selected: torch.Tensor
    d2t: torch.Tensor
    t2d: torch.Tensor
    coverage: float = 1.0
    fingerprint: str = ""

    @property
    def draft_vocab_size(self) -> int:
        return int(self.selected.numel())

    @property
    def target_vocab_size(self) -> int:
        return int(self.t2d.numel())

    @property
    def is_identity(self) -> bool:
        return self.draft_vocab_size == self.target_vocab_size

    @classmethod
    def from_selected(cls, selected: torch.Tensor, vocab_size: int, coverage: float = 1.0, fingerprint: str = ""):
        selected = torch.as_tensor(selected, dtype=torch.long)
        d2t = selected - torch.arange(selected.numel(), dtype=torch.long)
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[selected] = True
        mapping = cls(selected, d2t, t2d, coverage, fingerprint)
        mapping.validate()
        return mapping

    @classmethod
    def identity(cls, vocab_size: int, fingerprint: str = "") -> VocabMapping:
        return cls.from_selected(torch.arange(vocab_size), vocab_size, 1.0, fingerprint)

    def validate(self) -> None:
        """The §9 invariants; raises ``ValueError`` naming the first one that fails."""
        n = self.selected.numel()
        if self.d2t.dtype != torch.long or self.t2d.dtype != torch.bool:
            raise ValueError(f"d2t must be int64 and t2d bool, got {self.d2t.dtype} / {self.t2d.dtype}")
        if n > 1 and not bool((self.selected[1:] > self.selected[:-1]).all()):
            raise ValueError("selected ids must be strictly ascending")
        if not torch.equal(torch.arange(n) + self.d2t, self.selected):
            raise ValueError("d2t != selected - arange(N_d)")
        if int(self.t2d.sum()) != n or not torch.equal(torch.nonzero(self.t2d).flatten(), self.selected):
            raise ValueError("t2d does not mark exactly the selected ids")

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"d2t": self.d2t, "t2d": self.t2d, "selected": self.selected}

    def save(self, path: str | Path, fingerprint_fields: Mapping[str, Any] | None = None) -> Path:
        """``path`` (.safetensors: d2t, t2d, selected) + a ``.json`` sidecar with the fingerprint and its fields."""
        from safetensors.torch import save_file

        from lightning_eagle.atomic import atomic_file

        path = Path(path)
        meta = {"format": VOCAB_MAP_FORMAT, "fingerprint": self.fingerprint, "coverage": repr(self.coverage)}
        with atomic_file(path) as tmp:
            save_file({k: v.contiguous() for k, v in self.state_tensors().items()}, str(tmp), metadata=meta)
        sidecar = {**meta, "coverage": self.coverage, "fields": dict(fingerprint_fields or {})}
        with atomic_file(path.with_suffix(".json")) as tmp:
            tmp.write_text(json.dumps(sidecar, indent=2, sort_keys=True, default=str))
        return path

    @classmethod
    def load(cls, path: str | Path, expected_fingerprint: str | None = None) -> VocabMapping:
        """Load and validate; a fingerprint different from ``expected_fingerprint`` raises ``ValueError``."""
        from safetensors import safe_open

        path = Path(path)
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if meta.get("format") != VOCAB_MAP_FORMAT:
            raise ValueError(f"{path}: not a vocab map written by lightning_eagle (format {meta.get('format')!r})")
        fingerprint = meta.get("fingerprint", "")
        if expected_fingerprint is not None and fingerprint != expected_fingerprint:
            raise ValueError(
                f"{path}: vocab map fingerprint {fingerprint[:16]}… does not match the current data/tokenizer/options "
                f"({expected_fingerprint[:16]}…); rebuild it (delete the file) instead of reusing a stale map"
            )
        mapping = cls(
            tensors["selected"], tensors["d2t"], tensors["t2d"], float(meta.get("coverage", "1.0")), fingerprint
        )
        mapping.validate()
        return mapping


def vocab_map_fingerprint(fields: Mapping[str, Any]) -> str:
    """sha256 over the sorted JSON of ``fields`` (tokenizer hash, dataset identity, recovery + options, V, N_d)."""
    return hashlib.sha256(json.dumps(dict(fields), sort_keys=True, default=str).encode()).hexdigest()


def build_vocab_mapping(
    input_ids: Any,
    loss_mask: Any,
    target_vocab_size: int,
    draft_vocab_size: int | None,
    forced_ids: Sequence[int] = (),
    fingerprint: str = "",
) -> VocabMapping:
    """Build the draft vocabulary map from supervised data.

    ``input_ids`` / ``loss_mask``: a 2-D tensor or an iterable of 1-D rows (unequal lengths allowed).
    ``draft_vocab_size`` None or >= ``target_vocab_size`` gives the identity map. ``forced_ids`` (bos/eos/pad/unk,
    ``<|open|>``/``<|close|>``/``<|sep|>``/``<|end_of_msg|>``) are always selected.
    """
    if draft_vocab_size is None or draft_vocab_size >= target_vocab_size:
        return VocabMapping.identity(target_vocab_size, fingerprint)
    if draft_vocab_size <= 0:
        raise ValueError(f"draft_vocab_size must be positive, got {draft_vocab_size}")
    counts = count_supervised_tokens(input_ids, loss_mask, target_vocab_size)
    selected = select_draft_tokens(counts, draft_vocab_size, forced_ids)
    total = int(counts.sum())
    coverage = float(counts[selected].sum()) / total if total else 1.0
    log.info(
        "draft vocab: %d of %d target ids cover %.2f%% of %d supervised tokens",
        draft_vocab_size,
        target_vocab_size,
        100 * coverage,
        total,
    )
    return VocabMapping.from_selected(selected, target_vocab_size, coverage, fingerprint)
