"""The rows of a features folder, read lazily from its memory-mapped shards."""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from typing_extensions import override

from lightning_eagle.features import format as fmt


class FeatureRows(torch.utils.data.Dataset):
    """Rows ``[start, stop)`` of a dump, read lazily from the memory-mapped shards (one open handle per shard)."""

    def __init__(self, folder: Path, manifest: dict[str, Any], start: int, stop: int) -> None:
        self.folder, self.start, self.stop = folder, start, stop
        self.bounds, self.shards = self._layout(manifest)
        self._handles: dict[int, Any] = {}
        self._offsets: dict[int, torch.Tensor] = {}

    @override
    def __len__(self) -> int:
        return self.stop - self.start

    def __getstate__(self):  # loader workers open their own handles
        return {**self.__dict__, "_handles": {}, "_offsets": {}}

    def _layout(self, manifest: dict[str, Any]) -> tuple[list[int], list[str]]:
        """Row boundaries and file names of the shards (a row or token budget: sizes differ)."""
        return fmt.shard_bounds(manifest), [s["shard"] for s in manifest["shards"]]

    def _open(self, k: int) -> None:
        self._handles[k] = safe_open(str(self.folder / self.shards[k]), framework="pt")
        self._offsets[k] = self._handles[k].get_tensor("offsets")

    def _shard(self, k: int):
        if k not in self._handles:
            self._open(k)
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

    def loss_masks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss_mask, offsets)`` of rows ``[start, stop)``, flat: their supervision without reading any state."""
        if self.stop <= self.start:
            return torch.zeros(0, dtype=torch.uint8), torch.zeros(1, dtype=torch.int64)
        (first, begin), (last, end) = self._locate(self.start), self._locate(self.stop - 1)
        masks, lengths = [], []
        for k in range(first, last + 1):
            handle, offsets = self._shard(k)
            lo = begin if k == first else 0
            hi = end + 1 if k == last else offsets.numel() - 1
            masks.append(handle.get_slice("loss_mask")[int(offsets[lo]) : int(offsets[hi])])
            lengths.append(torch.diff(offsets[lo : hi + 1]))
        return torch.cat(masks), torch.cat([torch.zeros(1, dtype=torch.int64), torch.cat(lengths).cumsum(0)])

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
