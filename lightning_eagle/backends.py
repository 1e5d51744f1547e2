"""One convention for every component that has fast paths: a named ``*_backend`` setting (``kda_backend``,
``mla_backend``, ``experts_backend``, the draft's ``attention_backend``) whose values a :class:`BackendRegistry`
lists, checks and resolves.

``"auto"`` is always a choice and is resolved per device in one place, the registry's ``auto`` rule, so that one
config runs the CPU tests and the GPU run alike. A name the registry does not list is refused with the setting's name
and the choices (never a silent fall-through to some other path).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

AUTO = "auto"


@dataclass(frozen=True)
class BackendRegistry:
    """The backends of one setting.

    ``setting``: the name the user types (``"kda_backend"``); ``what``: what a backend is, for messages (``"KDA
    backend"``); ``names``: every concrete backend → one line saying why it exists; ``auto``: ``(device, **facts) ->
    name`` — the backend ``"auto"`` runs on that device (``facts``: whatever else the rule needs, e.g. the dtype).
    """

    setting: str
    what: str
    names: Mapping[str, str]
    auto: Callable[..., str]

    def __post_init__(self) -> None:
        if AUTO in self.names:
            raise ValueError(f"{self.setting}: {AUTO!r} is the registry's own rule, not a backend of its own")

    @property
    def choices(self) -> tuple[str, ...]:
        """``"auto"`` first, then the concrete backends in registration order."""
        return (AUTO, *self.names)

    def check(self, requested: str) -> str:
        """``requested`` if it is one of :attr:`choices`; else ``ValueError`` naming the setting and the choices."""
        if requested not in self.choices:
            raise ValueError(
                f"unknown {self.what} {requested!r}: {self.setting} must be one of {', '.join(self.choices)}"
            )
        return requested

    def resolve(self, requested: str, device: Any, **facts: Any) -> str:
        """The concrete backend that runs for ``requested`` on ``device`` (``"auto"`` through :attr:`auto`)."""
        if self.check(requested) != AUTO:
            return requested
        chosen = self.auto(device, **facts)
        if chosen not in self.names:  # a broken rule must not reach a dispatch that falls through to some path
            raise RuntimeError(f"{self.setting}: the auto rule chose {chosen!r}, not one of {list(self.names)}")
        return chosen

    def with_backend(self, name: str, why: str) -> BackendRegistry:
        """A copy that also lists ``name`` (a backend registered by a user)."""
        return dataclasses.replace(self, names={**self.names, name: why})


class BackendSetting:
    """A per-instance attribute holding a backend name, checked by its registry whenever it is assigned::

    class NoPEMLA(nn.Module):
        mla_backend = BackendSetting(MLA_BACKEND)
    """

    def __init__(self, registry: BackendRegistry) -> None:
        self.registry = registry

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_{name}"

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return obj.__dict__[self.slot]

    def __set__(self, obj: Any, value: str) -> None:
        obj.__dict__[self.slot] = self.registry.check(value)


# ---- the run settings' backends (``model.draft.attention_backend``, ``model.objective.loss_backend``) ---------------
# Their registries live here, under the settings that name them: the settings check a name once where they are made,
# the draft and the loss dispatch on it, and the memory plan resolves ``auto`` for the devices it plans.
def flex_attention_available(device: Any) -> bool:
    """Whether the fused flex kernel (forward *and* backward) can run here: a CUDA device with Triton."""
    import torch

    if torch.device(device).type != "cuda":
        return False
    from torch.utils._triton import has_triton

    return has_triton()


def default_ttt_attention(device: Any, *, flex_available: bool | None = None) -> str:
    """The TTT attention ``"auto"`` runs on ``device``: CUDA → ``flex_attention`` (compiled) when Triton is there,
    else ``sdpa_mask``; CPU and anything else → ``flash_lse`` (no flex backward on CPU; the fused CPU flash kernel).
    ``flex_available``: the Triton fact for a device that is not this machine's (the memory plan's GPUs); None asks
    this machine."""
    import torch

    if torch.device(device).type == "cuda":
        flex = flex_attention_available(device) if flex_available is None else flex_available
        return "flex_attention" if flex else "sdpa_mask"
    return "flash_lse"


def default_loss_backend(device: Any) -> str:
    """``"chunked"`` on every real device: it is what lets T grow (no K × ``[B,T,N_d]`` logits and log-probs kept for
    the backward, no ``[B,T,N_d]`` teacher), and on CPU it was also measured 2–3× faster than the plain twin for the
    loss part (T 1024–4096, N_d 2048, H 256: the plain path streams several ``[T,N_d]`` fp32 tensors through
    memory per step). ``"plain"`` on the meta device, whose tensors have no values for the supervised-slot selection
    the chunked path does (a memory census runs the unroll there)."""
    import torch

    return "plain" if torch.device(device).type == "meta" else "chunked"


TTT_ATTENTION_BACKEND = BackendRegistry(
    setting="attention_backend",
    what="TTT attention backend",
    names={
        "eager": "[B,n,T,T+k] scores and fp32 probabilities: the readable twin, the reference's formulation",
        "flash_lse": "LSE-returning causal block + k diagonal columns merged through the LSE: no [B,n,T,T+k]",
        "sdpa_mask": "one SDPA call over the concatenated keys with a boolean mask (fused on CUDA)",
        "flex_attention": "compiled flex_attention with a block mask: masked tiles skipped (CUDA; forward-only on CPU)",
    },
    # Looked up at call time, so the per-device rule has one home (and a test can swap it).
    auto=lambda device, **facts: default_ttt_attention(device, **facts),
)
LOSS_BACKEND = BackendRegistry(
    setting="loss_backend",
    what="TTT loss backend",
    names={
        "plain": "draft.logits + step_loss_fn against [B,T,N_d] teacher probs: the readable twin, every research hook",
        "chunked": "fused lm_head + soft CE over row chunks, teacher recomputed per chunk: no [B,T,N_d] tensor",
    },
    auto=lambda device, **facts: default_loss_backend(device),
)
