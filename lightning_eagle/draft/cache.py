"""The per-batch K/V cache of the TTT unroll (`eagle3_training.md` §4.1).

Each draft step appends the keys/values it computed for *all* slots; step k's queries then attend to the step-0 keys
(causal block) plus one diagonal column per later step. The cache also owns the attention mask: it is bound on the
first step and must stay the same for every later step (§4.3 forbids any per-step mask change — the historical
"mask shrink" bug), so the mask is built once and a changed mask is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from lightning_eagle.draft.block_attention import CausalBlock
from lightning_eagle.ops.mla import causal_additive_mask


class TTTCache:
    """``keys[i]`` ``[B,n,T,d_qk]`` and ``values[i]`` ``[B,n,T,d_v]`` of step i; a fresh cache per batch."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.attention_mask: torch.Tensor | None = None  # [B,T] {0,1}, bound on the first step
        self._bound = False
        # Masks derived from the bound mask (additive, boolean, a backend's block mask), built once per batch.
        self._masks: dict[Hashable, Any] = {}

    def __len__(self) -> int:
        return len(self.keys)

    def replay(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> TTTCache:
        """A cache holding ``keys``/``values`` with this cache's mask (and its built masks): what a recomputed step
        (activation checkpointing) appends to instead of this one."""
        other = TTTCache()
        other.keys, other.values = list(keys), list(values)
        other.attention_mask, other._bound, other._masks = self.attention_mask, self._bound, self._masks
        return other

    def bind_mask(self, attention_mask: torch.Tensor | None) -> None:
        """Record the padding mask on the first step; later steps must pass the same mask (values, not a shrink)."""
        if not self._bound:
            self.attention_mask = attention_mask
            self._bound = True
            return
        same = attention_mask is self.attention_mask or (
            attention_mask is not None
            and self.attention_mask is not None
            and attention_mask.shape == self.attention_mask.shape
            and torch.equal(attention_mask.to(torch.bool), self.attention_mask.to(torch.bool))
        )
        if not same:
            raise ValueError(
                "the TTT attention mask must stay constant across steps (eagle3_training.md §4.3); "
                "a different mask was passed at step " + str(len(self.keys))
            )

    def to_attention_layout(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This step's projections as the attention backend and the cache take them; the identity here. A
        sequence-parallel cache turns token-sharded ``[B,n,T/s,d]`` into head-sharded ``[B,n/s,T,d]``."""
        return q, k, v

    def to_token_layout(self, o: torch.Tensor) -> torch.Tensor:
        """The attention output back in the layout of the layer's other ops (the inverse of
        :meth:`to_attention_layout`); the identity here."""
        return o

    def append(self, key: torch.Tensor, value: torch.Tensor) -> int:
        """Add this step's K/V; returns the step index k (0 for the first call)."""
        self.keys.append(key)
        self.values.append(value)
        return len(self.keys) - 1

    def derived_mask(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """A mask derived from the bound padding mask, built by ``build()`` on first use and kept for the whole
        unroll (shared with :meth:`replay`s). ``key`` names what is built (backend, shape, dtype, device)."""
        if key not in self._masks:
            self._masks[key] = build()
        return self._masks[key]

    def causal_block(self, T: int, device: torch.device) -> CausalBlock | None:
        """The step-0 block rule without any ``[T,T]`` tensor (the long-context form): a
        :class:`~lightning_eagle.draft.block_attention.CausalBlock` when the bound mask is None or right-padded (every
        row a prefix of ones: the training batches), None for any other mask (left padding, holes), which then needs
        :meth:`additive_mask`. Checked once per batch (one host sync), kept with the derived masks."""

        def build() -> CausalBlock | None:
            if self.attention_mask is None:
                return CausalBlock()
            keep = self.attention_mask.to(device=device, dtype=torch.bool)
            if keep.shape[-1] != T:
                raise ValueError(f"the bound attention mask covers {keep.shape[-1]} slots, the queries {T}")
            if bool((keep[:, 1:] & ~keep[:, :-1]).any()):  # a real slot after a padding one: not right padding
                return None
            lengths = keep.sum(-1)
            return CausalBlock() if bool((lengths == T).all()) else CausalBlock(lengths)

        return self.derived_mask(("causal_block", T, torch.device(device)), build)

    def additive_mask(self, T: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``[B|1,1,T,T]`` additive causal ∧ key-not-pad mask (``finfo.min`` where disallowed), built once per dtype.
        O(T²) (8.6 GB per row at T = 65536 in fp16): the ``eager`` twin's, and ``flash_lse``'s only for a mask that is
        not right-padded (:meth:`causal_block`)."""
        return self.derived_mask(
            ("additive", T, dtype, torch.device(device)),
            lambda: causal_additive_mask(self.attention_mask, T, dtype=dtype, device=device),
        )

    def allowed_mask(self, T: int, device: torch.device) -> torch.Tensor:
        """The same rule as a boolean ``[B|1,1,T,T]`` (True = may attend); every row allows key 0. O(T²): used by
        ``sdpa_mask``, which is not a long-context backend (``flash_lse`` is)."""
        # Derived from the additive mask's own rule (one definition); the fp32 intermediate is not kept.
        return self.derived_mask(
            ("allowed", T, torch.device(device)),
            lambda: causal_additive_mask(self.attention_mask, T, dtype=torch.float32, device=device) == 0,
        )
