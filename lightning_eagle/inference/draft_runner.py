"""Draft inference: the EAGLE-3 draft proposes K tokens from the target's aux features of the accepted prefix.

Alignment (`eagle3_training.md` §2): draft slot t combines ``embed(x_{t+1})`` with ``fc(a_t)`` (the target's aux
features at position t) and proposes x_{t+2}. At inference the target has processed positions 0..n−1 and produced
x_n, so the last slot is n−1 and its step-0 output proposes x_{n+1}; later proposals continue from the draft's own
hidden state, exactly as TTT steps 1..K−1 do.

Attention reproduces the TTT cache (`eagle3_training.md` §4.2): at step k the query of slot t sees the **step-0 keys
of slots ≤ t** plus **this slot's own keys of steps 1..k**. Hence two caches:

* the *context* cache — step-0 keys/values of every accepted slot; it only grows, one slot per accepted position
  (:meth:`DraftRunner.extend`, run after each verification on the newly accepted positions);
* the *chain* cache — keys/values of steps 1..k of the last slot, private to one :meth:`DraftRunner.propose` call and
  discarded with it (that is the draft's whole rollback: chain entries never enter the context cache).

The layer maths reuse the draft's own modules (``draft.step_with`` → ``midlayer.run``: the same combine, projections,
MLP and norms as training; ``logits``); only the attention core is replaced by the two-cache form above.

:meth:`DraftRunner.extend` attends with the MLA core named by ``mla_backend`` (``"sdpa"``: no score tensor, a boolean
``[T,L]`` causal mask after a prefix, none for the first extension; ``"eager"``: fp32 ``[B,n,T,L]`` scores, the
twin). A long prompt is extended chunk by chunk (the speculative loop's ``prefill_chunk``): each call's transients are
``[C,L]`` per head and the slots equal one extension over the whole prompt to fp32 rounding.

Positions (rotary drafts, ``architecture="deepseek_mla"``; the NoPE K3 draft ignores them): context slot t stands at
position t (the target position of its aux features, as in the engines' draft-extend pass), and chain step j of the
last slot n−1 at n−1+j — the TTT convention ``t + k`` (:mod:`lightning_eagle.draft.deepseek_mla`). Keys are cached
rotated, so a cached key never needs its position again.

Extension point: any :class:`~lightning_eagle.inference.drafter.Drafter` (``reset()``, ``extend(aux, next_ids)``,
``propose(...)`` returning a :class:`~lightning_eagle.inference.drafter.DraftProposal`) can drive
:func:`~lightning_eagle.inference.speculative_generate`; this runner is the EAGLE-3 draft's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_eagle.backends import BackendSetting
from lightning_eagle.draft.block_attention import accumulate_dtype
from lightning_eagle.inference.drafter import DraftProposal
from lightning_eagle.inference.sampling import nucleus
from lightning_eagle.ops.mla import MLA_BACKEND, MLA_CORES

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def draft_layer_step(
    draft, input_ids: torch.Tensor, hidden: torch.Tensor, attend: Attend, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """One draft step with a caller-supplied attention core ``attend(q, k, v) -> o [B,n,T,d_v]`` at absolute
    ``positions [T]`` (ignored by the NoPE K3 draft).

    The same ops as ``KimiK3Eagle3Draft.layer`` (both run ``midlayer.run``; the inference tests check it against the
    training-time TTT unroll for both architectures)."""
    return draft.step_with(input_ids, hidden, attend, positions)


def ensure_draft_embedding(draft, target=None) -> None:
    """Never draft with a missing embedding. The draft's (frozen) embedding *is* the target's, so the serving export
    omits it (§14.1) and ``KimiK3Eagle3Draft.from_pretrained`` leaves it NaN; fill it from ``target``'s
    ``embed_tokens.weight`` in place.

    Raises ``ValueError`` when it is not finite and cannot be filled: no target, shapes that differ, or an embedding
    the draft trained (``freeze_embeddings`` false), for which the target's is no substitute.
    """
    weight = draft.embed_tokens.weight
    if _all_finite(weight):
        return
    problem = "the draft's embedding is missing (NaN: its export omits the frozen embedding) or not finite"
    if not draft.config.freeze_embeddings:
        raise ValueError(
            f"{problem}, and the draft trained its own embedding (freeze_embeddings=False), so the target's cannot "
            "replace it; load the draft from an export that includes embed_tokens.weight"
        )
    if target is None:
        raise ValueError(
            f"{problem}; pass the target (DraftRunner(draft, target)) or call "
            "draft.copy_embeddings_from(target.model.embed_tokens.weight) first"
        )
    source = target.model.embed_tokens.weight
    if tuple(source.shape) != tuple(weight.shape):
        raise ValueError(
            f"{problem}, and the target's embed_tokens.weight {tuple(source.shape)} cannot fill it: the draft needs "
            f"{tuple(weight.shape)} (vocab_size, hidden_size)"
        )
    draft.copy_embeddings_from(source)
    if not _all_finite(weight):
        raise ValueError(f"{problem}, and the target's embed_tokens.weight is not finite either")


def _all_finite(weight: torch.Tensor, rows: int = 1 << 14) -> bool:
    # Row blocks bound the temporary mask: the real embedding is 163840 × 7168.
    return all(bool(torch.isfinite(block).all()) for block in weight.detach().split(rows))


class DraftRunner:
    """Incremental inference for a :class:`~lightning_eagle.draft.KimiK3Eagle3Draft` of either architecture (batch
    rows share a length).

    ``target`` (optional) fills a missing draft embedding (:func:`ensure_draft_embedding`); without it a missing one
    raises. ``mla_backend``: the attention core of :meth:`extend` (:data:`~lightning_eagle.ops.mla.MLA_BACKEND`:
    ``"auto"`` = ``"sdpa"``, or ``"eager"``)."""

    mla_backend = BackendSetting(MLA_BACKEND)

    def __init__(self, draft, target=None, mla_backend: str = "auto") -> None:
        ensure_draft_embedding(draft, target)
        self.draft = draft
        self.mla_backend = mla_backend
        self.reset()

    def reset(self) -> None:
        self.keys: torch.Tensor | None = None  # [B,n,L,d_qk] step-0 keys of the accepted slots
        self.values: torch.Tensor | None = None
        self.last_hidden: torch.Tensor | None = None  # [B,1,H] step-0 output of the last slot

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def selected_token_ids(self) -> torch.Tensor:
        return self.draft.selected_token_ids

    @torch.no_grad()
    def extend(self, aux_hidden_states: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """Add slots for newly accepted positions: ``aux_hidden_states [B,T,3H_t]`` of those positions and
        ``next_ids [B,T]`` = the token that *followed* each of them (x_{t+1}). Returns their step-0 hidden states."""
        if next_ids.dim() == 1:
            next_ids = next_ids[None]
        if aux_hidden_states.shape[:2] != next_ids.shape:
            raise ValueError(
                f"one next token per aux row: aux {tuple(aux_hidden_states.shape)} vs next_ids {tuple(next_ids.shape)}"
            )
        device = self.draft.fc.weight.device
        hidden = self.draft.project(aux_hidden_states.to(device))
        scale = self.draft.midlayer.scale
        positions = torch.arange(self.length, self.length + next_ids.shape[1], device=device)  # slot t at t

        core = MLA_CORES[MLA_BACKEND.resolve(self.mla_backend, device)]

        def attend(q, k, v):
            self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
            self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
            # Step-0 semantics: causal over the context slots, new slot i standing at L−T+i (mask None = causal
            # with the cached keys in front: the cores build at most a [T,L] mask, none when nothing is cached).
            return core(q, self.keys, self.values, None, scale)

        h = draft_layer_step(self.draft, next_ids.to(device), hidden, attend, positions)
        self.last_hidden = h[:, -1:]
        return h

    @torch.no_grad()
    def propose(
        self,
        num_tokens: int,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        top_p: float = 1.0,
        forced_tokens: list[int] | None = None,
    ) -> DraftProposal:
        """Draft ``num_tokens`` tokens from the last slot: greedy at temperature 0, else sampled from the top-p nucleus
        of ``softmax(z / temperature)`` (:func:`~lightning_eagle.inference.sampling.nucleus`; ``probs`` is that
        nucleus, the q rejection sampling divides by). ``forced_tokens`` (tests) replaces the first picks by the given
        target ids, i.e. runs the chain as if the drafts had been those tokens."""
        if self.last_hidden is None:
            raise RuntimeError("DraftRunner.propose before extend: the draft has no context")
        draft = self.draft
        scale = draft.midlayer.scale
        last = self.length - 1  # position of the last slot; chain step j stands at last + j
        selected = draft.selected_token_ids
        chain_k: list[torch.Tensor] = []
        chain_v: list[torch.Tensor] = []

        def attend(q, k, v):
            # Step k ≥ 1 at the last slot: all context (step-0) keys are ≤ the slot, plus its own keys of steps 1..k.
            # One softmax over both score blocks; the context keys are not copied (they can be long).
            chain_k.append(k)
            chain_v.append(v)
            keys, values = torch.cat(chain_k, dim=2), torch.cat(chain_v, dim=2)
            scores = torch.cat(
                [torch.matmul(q, self.keys.transpose(-1, -2)), torch.matmul(q, keys.transpose(-1, -2))], -1
            )
            probs = torch.softmax((scores * scale).to(accumulate_dtype(scores.dtype)), dim=-1).to(q.dtype)
            L = self.keys.shape[2]
            return torch.matmul(probs[..., :L], self.values) + torch.matmul(probs[..., L:], values)

        h = self.last_hidden
        if h.shape[0] != 1:
            raise ValueError(f"propose drafts one chain for one row; the context has batch {h.shape[0]}")
        tokens, draft_ids, all_probs, all_logits = [], [], [], []
        for j in range(num_tokens):
            if j:
                position = torch.tensor([last + j], device=h.device)
                h = draft_layer_step(draft, tokens[-1].view(1, 1), h, attend, position)
            logits = draft.logits(h)[0, -1].float()  # [N_d]
            if temperature > 0:
                probs = nucleus(torch.softmax(logits / temperature, dim=-1), top_p)
                pick = torch.multinomial(probs, 1, generator=generator)[0]
                all_probs.append(probs)
            else:
                pick = logits.argmax()
            token = selected[pick]
            if forced_tokens is not None and j < len(forced_tokens):
                token = torch.tensor(forced_tokens[j], device=pick.device)
            tokens.append(token)
            draft_ids.append(pick)
            all_logits.append(logits)
        n_d, device = selected.numel(), selected.device
        return DraftProposal(
            tokens=torch.stack(tokens) if tokens else torch.zeros(0, dtype=torch.long, device=device),
            draft_ids=torch.stack(draft_ids) if draft_ids else torch.zeros(0, dtype=torch.long, device=device),
            probs=(torch.stack(all_probs) if all_probs else torch.zeros(0, n_d, device=device))
            if temperature > 0
            else None,
            logits=torch.stack(all_logits) if all_logits else torch.zeros(0, n_d, device=device),
        )
