"""Expert-parallel token dispatch for the frozen K3 target (``k3_target.md`` §5.2, ``eagle3_training.md`` §12).

A dispatcher is called by every MoE layer as ``dispatch(experts, x_TD, topk_idx_TK, topk_weight_TK)`` and returns
the fp32 ``[T, D]`` sum ``Σ_k w_k · y_{e_k}`` over **all** experts for this rank's ``T`` tokens, although
``experts`` holds only this rank's contiguous slice. Routing is identical on every rank (fp32 router, replicated
weights), so the ranks only need to move tokens and partial sums.

Shape suffixes (torchtitan style): ``T`` tokens on this rank, ``D`` expert hidden width (the latent width ``H_l``),
``K`` experts per token, ``R`` ranks of the EP group, ``S`` rows sent by this rank, ``M`` rows received.

* :class:`TorchExpertDispatcher` (``target_dispatcher="torch"``, the default): a token travels once to each rank
  that owns at least one of its experts (uneven ``all_to_all_single``), that rank computes the fp32 partial sum
  over its local experts, and the partial sums travel back the same way.
* :class:`AllGatherExpertDispatcher`: the readable reference twin (every rank sees every token, fp32 all-reduce).
* :class:`DeepEPDispatcher` / :class:`HybridEPDispatcher`: accepted names that fail at construction, never falling
  back to torch (a silent fallback once hid missing builds until a multi-node run).

Neither torch dispatcher back-propagates: the target is frozen and runs under ``no_grad``.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from lightning_eagle.k3.experts import RoutedExperts
from lightning_eagle.parallel.shard import check_expert_slice
from lightning_eagle.parallel.validate import DISPATCHERS


def _check_no_grad(x_TD: torch.Tensor) -> None:
    # Plain collectives are not differentiable: a graph through them would silently stop at the exchange.
    if torch.is_grad_enabled() and x_TD.requires_grad:
        raise RuntimeError(
            "expert-parallel dispatch does not back-propagate; run the frozen target under torch.no_grad()"
        )


def _pack_rows(*tensors: torch.Tensor) -> torch.Tensor:
    """Rows of 2-D tensors of different dtypes side by side as raw bytes ``[S, Σ bytes]``: one collective, not one
    per tensor (each collective pays a latency; three per MoE layer and forward add up over 92 layers)."""
    return torch.cat([t.contiguous().view(torch.uint8) for t in tensors], dim=1)  # [S, n] → [S, n·itemsize]


def _unpack_rows(packed: torch.Tensor, *like: torch.Tensor) -> list[torch.Tensor]:
    """Inverse of :func:`_pack_rows`; ``like`` gives each part's dtype and row width."""
    parts, offset = [], 0
    for t in like:
        width = t.shape[1] * t.element_size()
        parts.append(packed[:, offset : offset + width].contiguous().view(t.dtype))
        offset += width
    return parts


class _GroupDispatcher:
    """What both torch dispatchers share: the expert-parallel group, and the checks every call makes before its
    first collective (no autograd graph through the exchange; ``experts`` holds this rank's slice)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)

    def __call__(
        self,
        experts: RoutedExperts,
        x_TD: torch.Tensor,
        topk_idx_TK: torch.Tensor,
        topk_weight_TK: torch.Tensor,
    ) -> torch.Tensor:
        _check_no_grad(x_TD)
        check_expert_slice(experts, self.ep_size, self.ep_rank)
        return self._dispatch(experts, x_TD, topk_idx_TK, topk_weight_TK)

    def max_over_group(self, value: int, device: torch.device) -> int:
        """The largest ``value`` over the EP group (one all-reduce): the token-chunked target forward agrees on its
        segment count with it, so every rank makes the same number of dispatch calls per layer (``k3/token_chunks.py``;
        a rank with fewer tokens dispatches empty segments, which both dispatchers handle)."""
        t = torch.tensor([value], dtype=torch.long, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t)

    def _dispatch(
        self, experts: RoutedExperts, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weight_TK: torch.Tensor
    ) -> torch.Tensor:
        raise NotImplementedError


class TorchExpertDispatcher(_GroupDispatcher):
    """Uneven all-to-all dispatch with torch.distributed (gloo and NCCL).

    Steps for one MoE layer::

        x_TD, topk_idx_TK ──(which ranks own the K experts?)──> needs_TR          # bool
        rank-major send list: for r in R: tokens t with needs_TR[t, r]             # token_S, sorted by rank
        all_to_all(counts)      send_counts_R ──> recv_counts_R                    # the only host sync
        all_to_all(tokens)      [x | topk_idx | topk_weight][token_S] ──> x_MD, topk_idx_MK, topk_weight_MK
        local experts           y_MD = experts(x_MD, topk_idx_MK, topk_weight_MK)  # fp32 partial sums
        all_to_all(back)        y_MD ──> y_SD (splits swapped)                     # fp32
        combine                 out_TD.index_add_(0, token_S, y_SD)                # fp32, once per owning rank

    Sending a token once per *rank* (not once per expert) means a token whose K experts share a rank costs one
    row, and the receiver reuses :class:`RoutedExperts` unchanged (it ignores slots routed elsewhere). Three
    collectives per layer: the counts, the tokens with their routing (packed into one byte tensor), the results.
    """

    def _all_to_all(self, x: torch.Tensor, recv_splits: list[int], send_splits: list[int]) -> torch.Tensor:
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=self.group)
        return out

    def _dispatch(
        self, experts: RoutedExperts, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weight_TK: torch.Tensor
    ) -> torch.Tensor:
        T, D = x_TD.shape
        R = self.ep_size
        # Contiguous equal slices: expert e lives on EP rank e // experts_per_rank.
        dest_rank_TK = topk_idx_TK // experts.count
        needs_TR = torch.zeros(T, R, dtype=torch.bool, device=x_TD.device)
        needs_TR.scatter_(1, dest_rank_TK, True)
        # nonzero() of the transpose walks rank 0's tokens first, then rank 1's, ...: the order all_to_all expects.
        _, token_S = needs_TR.t().nonzero(as_tuple=True)
        send_counts_R = needs_TR.sum(0)
        recv_counts_R = torch.empty_like(send_counts_R)
        dist.all_to_all_single(recv_counts_R, send_counts_R, group=self.group)
        send_splits, recv_splits = send_counts_R.tolist(), recv_counts_R.tolist()

        routed_S = (x_TD[token_S], topk_idx_TK[token_S], topk_weight_TK[token_S])
        packed_M = self._all_to_all(_pack_rows(*routed_S), recv_splits, send_splits)
        x_MD, topk_idx_MK, topk_weight_MK = _unpack_rows(packed_M, *routed_S)

        y_MD = experts(x_MD, topk_idx_MK, topk_weight_MK)  # fp32 partial sums over this rank's experts

        y_SD = self._all_to_all(y_MD, send_splits, recv_splits)  # back to the owners, still fp32
        out_TD = torch.zeros(T, D, dtype=torch.float32, device=x_TD.device)
        return out_TD.index_add_(0, token_S, y_SD)


class AllGatherExpertDispatcher(_GroupDispatcher):
    """Reference twin of :class:`TorchExpertDispatcher` (the reference implementation's ``"torch"`` semantics).

    Every rank gathers every rank's tokens and routing, computes its local experts' fp32 partial sums for all of
    them, an fp32 all-reduce adds the partial sums of all ranks, and each rank keeps its own rows. Ranks may hold
    different token counts: inputs are padded to the largest count for the gather and trimmed afterwards.
    Communication grows with ``ep_size × all tokens``, which is why it is the twin and not the default.
    """

    def _gather_padded(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        padded = x.new_zeros((max(counts), *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([p[:n] for p, n in zip(parts, counts)])

    def _dispatch(
        self, experts: RoutedExperts, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weight_TK: torch.Tensor
    ) -> torch.Tensor:
        T = x_TD.shape[0]
        count = torch.tensor([T], dtype=torch.long, device=x_TD.device)
        counts_R = [torch.empty_like(count) for _ in range(self.ep_size)]
        dist.all_gather(counts_R, count, group=self.group)
        counts = [int(c) for c in counts_R]
        x_AD = self._gather_padded(x_TD, counts)  # A = all tokens of the group, rank-major
        topk_idx_AK = self._gather_padded(topk_idx_TK, counts)
        topk_weight_AK = self._gather_padded(topk_weight_TK, counts)
        y_AD = experts(x_AD, topk_idx_AK, topk_weight_AK)  # fp32, zero rows for tokens without a local expert
        dist.all_reduce(y_AD, group=self.group)
        start = sum(counts[: self.ep_rank])
        return y_AD[start : start + T]


# ---- GPU libraries: accepted names, never a silent fallback ----------------------------------------------------------

_INSTALL_DEEP_EP = (
    "build and install DeepEP from https://github.com/deepseek-ai/DeepEP (import name `deep_ep`; "
    "`pip install --no-build-isolation git+https://github.com/deepseek-ai/DeepEP`, needs CUDA and NVSHMEM)"
)
_INSTALL_HYBRID_EP = (
    "build and install DeepEP's hybrid-ep branch, which provides `deep_ep.HybridEpBuffer` "
    "(`pip install --no-build-isolation git+https://github.com/deepseek-ai/DeepEP@hybrid-ep`, needs CUDA)"
)


class _LibraryDispatcher:
    """A GPU library dispatcher: checks at construction that the library can be used, raises otherwise."""

    name: str = ""
    package: str = "deep_ep"
    required_attr: str | None = None
    install: str = _INSTALL_DEEP_EP

    @classmethod
    def check_available(cls) -> None:
        """Raise ``ImportError`` (naming the package to install) or ``NotImplementedError``; never fall back."""
        require_library(cls.name)
        # Importable, but this project has no DeepEP integration yet: say so instead of running something else.
        # (DeepEP's combine also adds partial sums in bf16, which would break the fp32 parity with one process.)
        raise NotImplementedError(
            f"target_dispatcher={cls.name!r}: the {cls.package} integration is not implemented in lightning_eagle "
            "yet; use target_dispatcher='torch'"
        )

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.check_available()


class DeepEPDispatcher(_LibraryDispatcher):
    name = "deepep"


class HybridEPDispatcher(_LibraryDispatcher):
    name = "hybridep"
    required_attr = "HybridEpBuffer"
    install = _INSTALL_HYBRID_EP


_LIBRARY_DISPATCHERS = {"deepep": DeepEPDispatcher, "hybridep": HybridEPDispatcher}


def require_library(name: str) -> None:
    """Raise ``ImportError`` naming the package to install if ``target_dispatcher=name`` cannot be imported."""
    cls = _LIBRARY_DISPATCHERS[name]
    try:
        module = importlib.import_module(cls.package)
    except ImportError as err:
        raise ImportError(
            f"target_dispatcher={name!r} needs the `{cls.package}` package, which is not importable ({err}): "
            f"{cls.install}; or use target_dispatcher='torch'"
        ) from None
    if cls.required_attr is not None and not hasattr(module, cls.required_attr):
        raise ImportError(
            f"target_dispatcher={name!r} needs `{cls.package}.{cls.required_attr}`, which this `{cls.package}` build "
            f"lacks: {cls.install}; or use target_dispatcher='torch'"
        )


def _unknown(name: str) -> ValueError:
    return ValueError(f"target_dispatcher={name!r} is unknown; choose one of {DISPATCHERS}")


def check_dispatcher(name: str) -> None:
    """Construction-time check of ``target_dispatcher``: unknown names and unusable GPU libraries raise here."""
    if name in _LIBRARY_DISPATCHERS:
        _LIBRARY_DISPATCHERS[name].check_available()
    elif name != "torch":
        raise _unknown(name)


def build_dispatcher(name: str, group: dist.ProcessGroup | None = None):
    """The dispatcher for ``target_dispatcher=name`` over ``group`` (the expert-parallel process group)."""
    if name == "torch":
        return TorchExpertDispatcher(group)
    if name in _LIBRARY_DISPATCHERS:
        return _LIBRARY_DISPATCHERS[name](group)
    raise _unknown(name)
