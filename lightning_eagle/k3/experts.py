"""Routed experts stored stacked, holding a contiguous slice ``[start, start + n)`` of the global experts.

Stacked layout (the grouped-GEMM order): ``gate_up_proj [n, H_l, 2I] = [w1ᵀ | w3ᵀ]`` (gate half first) and
``down_proj [n, I, H_l] = w2ᵀ``. Each expert output is rounded to the model dtype before weighting; the weighted sum
is fp32.

``storage="mxfp4"`` keeps the checkpoint's MXFP4 bytes instead (uint8 buffers ``gate_up_packed [n, 2I, H_l/2]`` =
``[w1; w3]`` rows, ``down_packed [n, H_l, I/2]`` = w2, plus their E8M0 scales): ~3.8x less expert memory than bf16
(what makes EP 64 fit beside the replicated weights), identical outputs. The grouped forward decodes all local
experts of the layer at once, one call per tensor: transient memory is the decoded layer in the model dtype (0.9 GB
in bf16 for K3's 14 experts per rank at EP 64) plus ~6 bytes per weight of scratch while a tensor decodes (~1.9 GB
for that ``gate_up``). The per-expert loop decodes one expert at a time.

The grouped forward (:meth:`RoutedExperts.forward`) runs one batched computation per layer, chosen by the setting
``experts_backend`` (:data:`EXPERTS_BACKEND`):

* ``"grouped_mm"`` — ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` over the expert-sorted rows with
  device-side group offsets: no padding, no host sync. Used by ``"auto"`` where a one-time probe shows it runs for
  the device and dtype (CUDA sm90 bf16; recent torch, e.g. 2.13, also runs it on CPU) and every row stride is
  16-byte aligned (:func:`auto_experts_backend`).
* ``"bmm"`` — each expert's rows padded to the largest group, then two ``bmm``: works everywhere, wastes
  ``n·max_group − pairs`` rows of compute and memory (the load imbalance), and reads the largest group size back to
  the host (one sync per layer: a static bound such as ``N`` rows per expert would cost ``n/k`` times the compute).

:meth:`RoutedExperts.forward_naive` (a per-expert loop with boolean masks) is the readable twin.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from lightning_eagle.backends import BackendRegistry, BackendSetting
from lightning_eagle.k3.mxfp4 import GROUP_SIZE, decode_mxfp4
from lightning_eagle.ops.situ import situ_and_mul
from lightning_eagle.run_settings import EXPERT_STORAGES

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_GROUPED_MM_PROBES: dict[tuple[str, int | None, torch.dtype], bool] = {}


def grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``grouped_mm`` exists and computes a tiny grouped product correctly on ``device``/``dtype``.

    Support varies by torch version, device, architecture and dtype, and an unsupported call raises on the host
    before any kernel runs, so two small calls per (device, dtype) and process are a safe probe (their result is read
    back once; the answer is cached)."""
    key = (device.type, device.index, dtype)
    if key not in _GROUPED_MM_PROBES:
        ok = False
        if _GROUPED_MM is not None:
            try:
                a = torch.arange(48, device=device).view(6, 8).to(dtype) / 8
                b = torch.arange(3 * 64, device=device).view(3, 8, 8).to(dtype) / 64
                want = torch.cat([a[:2] @ b[0], a[2:5] @ b[2], a[5:] @ b[2]]).float()
                # Both layouts forward uses: groups covering every row, and rows left past the last group
                # (expert-parallel slices); group 1 is empty in both.
                ok = True
                for offs, rows in (([2, 2, 6], 6), ([2, 2, 5], 5)):
                    got = _GROUPED_MM(a, b, offs=torch.tensor(offs, dtype=torch.int32, device=device))[:rows].float()
                    ok = ok and bool(torch.allclose(got, want[:rows], rtol=1e-2, atol=1e-2))
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _GROUPED_MM_PROBES[key] = ok
    return _GROUPED_MM_PROBES[key]


def auto_experts_backend(device: torch.device, dtype: torch.dtype, aligned: bool) -> str:
    """``grouped_mm`` where it runs for this device and dtype and every operand is laid out for it, else ``bmm``."""
    return "grouped_mm" if aligned and grouped_mm_runs(device, dtype) else "bmm"


EXPERTS_BACKEND = BackendRegistry(
    setting="experts_backend",
    what="routed-experts backend",
    names={
        "grouped_mm": "one grouped GEMM over the expert-sorted rows: no padding, no host sync",
        "bmm": "groups padded to the largest, two bmm: runs everywhere",
    },
    auto=auto_experts_backend,
)


def _rows_aligned(*mats: torch.Tensor) -> bool:
    """grouped_mm's layout rule: each matrix row- or column-major with its leading stride a multiple of 16 bytes."""
    for m in mats:
        alignment = 16 // m.element_size()
        rows, cols = m.stride(-2), m.stride(-1)
        if not ((cols == 1 and rows % alignment == 0) or (rows == 1 and cols % alignment == 0)):
            return False
    return True


class RoutedExperts(nn.Module):
    """The local slice of one layer's routed experts; :meth:`forward` is the grouped path (``experts_backend``),
    :meth:`forward_naive` its per-expert twin."""

    experts_backend = BackendSetting(EXPERTS_BACKEND)

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        expert_range: tuple[int, int] | None = None,
        beta: float | None = 4.0,
        linear_beta: float | None = 25.0,
        storage: str = "dequantized",
    ) -> None:
        super().__init__()
        if storage not in EXPERT_STORAGES:
            raise ValueError(f"expert storage must be one of {EXPERT_STORAGES}, got {storage!r}")
        start, count = expert_range if expert_range is not None else (0, num_experts)
        if not (0 <= start and count >= 1 and start + count <= num_experts):
            raise ValueError(f"expert_range {expert_range} is not a slice of the {num_experts} experts")
        self.num_experts, self.start, self.count = num_experts, start, count
        self.intermediate_size, self.hidden_size, self.storage = intermediate_size, hidden_size, storage
        inter, Hl = intermediate_size, hidden_size
        if storage == "dequantized":
            self.gate_up_proj = nn.Parameter(torch.empty(count, Hl, 2 * inter))
            self.down_proj = nn.Parameter(torch.empty(count, inter, Hl))
        else:
            if Hl % GROUP_SIZE or inter % GROUP_SIZE:
                raise ValueError(f"MXFP4 expert storage needs widths divisible by {GROUP_SIZE}, got {Hl} and {inter}")
            u8 = {"dtype": torch.uint8}
            self.register_buffer("gate_up_packed", torch.zeros(count, 2 * inter, Hl // 2, **u8))
            self.register_buffer("gate_up_scale", torch.zeros(count, 2 * inter, Hl // GROUP_SIZE, **u8))
            self.register_buffer("down_packed", torch.zeros(count, Hl, inter // 2, **u8))
            self.register_buffer("down_scale", torch.zeros(count, Hl, inter // GROUP_SIZE, **u8))
        self.beta, self.linear_beta = beta, linear_beta
        self.experts_backend = "auto"  # see the module docstring
        self._decoded: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] | None = None  # see decoded_once

    @contextmanager
    def decoded_once(self) -> Iterator[RoutedExperts]:
        """Within the block, MXFP4 storage is decoded by the first grouped forward and the decoded layer reused by
        the next ones (the token segments of one chunked layer: one decode per layer, not one per segment). The
        decoded layer, the grouped forward's largest transient anyway, stays alive until the block ends. A no-op
        for dequantized storage."""
        self._decoded = {}
        try:
            yield self
        finally:
            self._decoded = None

    @property
    def is_complete(self) -> bool:
        return self.count == self.num_experts

    def weights(self, local: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate_up [H_l, 2I], down [I, H_l])`` of one local expert (decoded on the fly for MXFP4 storage)."""
        if self.storage == "dequantized":
            return self.gate_up_proj[local], self.down_proj[local]
        gate_up = decode_mxfp4(self.gate_up_packed[local], self.gate_up_scale[local], dtype=dtype)
        down = decode_mxfp4(self.down_packed[local], self.down_scale[local], dtype=dtype)
        return gate_up.t(), down.t()

    def stored_tensors(self) -> tuple[torch.Tensor, ...]:
        if self.storage == "dequantized":
            return self.gate_up_proj, self.down_proj
        return self.gate_up_packed, self.gate_up_scale, self.down_packed, self.down_scale

    def expert(self, local: int, z: torch.Tensor) -> torch.Tensor:
        """One expert on ``z [n_tok, H_l]`` → model-dtype output ``[n_tok, H_l]``."""
        gate_up, down = self.weights(local, z.dtype)
        gate, up = (z @ gate_up).split(self.intermediate_size, dim=-1)
        return situ_and_mul(gate, up, self.beta, self.linear_beta) @ down

    def stacked_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate_up [n, H_l, 2I], down [n, I, H_l])`` of every local expert; MXFP4 storage is decoded in one call
        per tensor (the results are transposed views of the decoded ``[n, out, in]`` rows)."""
        if self.storage == "dequantized":
            return self.gate_up_proj, self.down_proj
        if self._decoded is not None and dtype in self._decoded:
            return self._decoded[dtype]
        gate_up = decode_mxfp4(self.gate_up_packed, self.gate_up_scale, dtype=dtype, check_scales=False)
        down = decode_mxfp4(self.down_packed, self.down_scale, dtype=dtype, check_scales=False)
        weights = gate_up.transpose(-1, -2), down.transpose(-1, -2)
        if self._decoded is not None:
            self._decoded[dtype] = weights
        return weights

    def forward(self, z: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        """Grouped path. Returns the fp32 partial sum ``Σ_j w_j · y_{e_j}`` over the (token, slot) pairs routed to
        *local* experts, ``[N, H_l]`` (zero rows for tokens with no local expert).

        The ``P = N·k`` pairs are sorted by local expert, pairs of non-local experts last (sort key ``n``); group
        ``e`` is the sorted rows ``[ends[e-1], ends[e])`` and only the first ``ends[-1]`` (local) pairs are computed.
        A complete slice (one process) has no non-local pair, so every shape is fixed by ``N·k`` and nothing is read
        back to the host on the grouped_mm backend. An expert-parallel slice reads its local-pair count once (the
        dispatcher has just synchronised on its all-to-all split sizes anyway): under EP a rank receives every row
        that needs *any* of its experts, and computing all ``k`` slots of those rows would cost ~``ep·k/…`` times the
        local work (14x at EP 64). Slot contributions are summed per token in slot order, not with atomic adds, so
        the fp32 sum is deterministic."""
        N, k = topk_idx.shape
        P = N * k
        H = z.shape[-1]
        if P == 0:
            return torch.zeros(N, H, dtype=torch.float32, device=z.device)
        local = topk_idx.reshape(-1) - self.start
        key = torch.where((local >= 0) & (local < self.count), local, self.count)
        key_sorted, order = key.sort(stable=True)
        ends = torch.searchsorted(key_sorted, torch.arange(self.count, device=z.device), right=True, out_int32=True)
        n_local = P if self.is_complete else int(ends[-1])  # router indices lie in [0, num_experts)
        if n_local == 0:
            return torch.zeros(N, H, dtype=torch.float32, device=z.device)
        pairs = order[:n_local]
        x = z[pairs // k]

        gate_up, down = self.stacked_weights(z.dtype)
        if self.resolve_backend(x, gate_up, down) == "grouped_mm":
            y = self._grouped_mm(x, gate_up, down, ends)
        else:
            y = self._padded_bmm(x, gate_up, down, key_sorted[:n_local], ends)
        weighted = y * topk_weight.reshape(P)[pairs].float()[:, None]  # fp32 (type promotion), y rounded first
        if n_local == P:
            return weighted[order.argsort()].view(N, k, H).sum(1)  # back to (token, slot) order, summed per token
        # Row of each (token, slot) pair among the computed ones; non-local pairs read an appended zero row.
        position = torch.full((P,), n_local, dtype=torch.long, device=z.device)
        position[pairs] = torch.arange(n_local, device=z.device)
        position = position.view(N, k)
        rows = torch.cat([weighted, weighted.new_zeros(1, H)])
        out = rows[position[:, 0]]
        for slot in range(1, k):  # N×H at a time, never N×k×H
            out = out + rows[position[:, slot]]
        return out

    def resolve_backend(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> str:
        """The backend :meth:`forward` uses for these operands (``experts_backend``, with ``"auto"`` resolved)."""
        # The SiTU output [P, I] is grouped_mm's operand too: I·(element size) must be a multiple of 16 bytes.
        aligned = _rows_aligned(x, gate_up, down) and self.intermediate_size * x.element_size() % 16 == 0
        backend = EXPERTS_BACKEND.resolve(self.experts_backend, x.device, dtype=x.dtype, aligned=aligned)
        if backend == "grouped_mm" and not (aligned and grouped_mm_runs(x.device, x.dtype)):
            raise RuntimeError(f"grouped_mm does not run here ({x.device}, {x.dtype}, or unaligned widths)")
        return backend

    def _grouped_mm(self, x, gate_up, down, ends):
        gate, up = _GROUPED_MM(x, gate_up, offs=ends).split(self.intermediate_size, dim=-1)
        return _GROUPED_MM(situ_and_mul(gate, up, self.beta, self.linear_beta), down, offs=ends)

    def _padded_bmm(self, x, gate_up, down, key_sorted, ends):
        """Each group gathered into ``[n, C, H_l]`` (``C`` = the largest group, short groups padded with a zero
        row), two bmm, then each sorted row read back from its padded slot. Gathers only: no scatter, no atomics."""
        n, (P, H) = self.count, x.shape
        starts = torch.cat([ends.new_zeros(1), ends[:-1]]).long()
        sizes = ends.long() - starts
        capacity = max(int(sizes.max()), 1)  # the one host sync of this backend
        j = torch.arange(capacity, device=x.device)
        source = torch.where(j < sizes[:, None], starts[:, None] + j, P)  # row P is the zero padding row
        padded = torch.cat([x, x.new_zeros(1, H)])[source]
        gate, up = torch.bmm(padded, gate_up).split(self.intermediate_size, dim=-1)
        y = torch.bmm(situ_and_mul(gate, up, self.beta, self.linear_beta), down).view(n * capacity, H)
        expert = key_sorted.long()  # local rows only: every key names one of the n experts
        return y[expert * capacity + torch.arange(P, device=x.device) - starts[expert]]

    def forward_naive(self, z: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        """Readable twin of :meth:`forward`: a plain loop over local experts with boolean masks."""
        out = torch.zeros(z.shape[0], z.shape[-1], dtype=torch.float32, device=z.device)
        for e in range(self.count):
            hit = topk_idx == self.start + e  # [N,k]
            rows = hit.any(-1)
            if rows.any():
                y = self.expert(e, z[rows]).float()
                w = (topk_weight * hit).sum(-1)[rows].float()
                out[rows] += w[:, None] * y
        return out
