"""Speculative-decoding inference for K3 EAGLE-3 drafts: incremental target, draft runner, lossless loop, acceptance.

Public API (stable): :func:`speculative_generate`, :func:`evaluate_acceptance`. Building blocks for notebooks and
research: :class:`IncrementalTarget` (prefill/extend/rollback), :class:`DraftRunner`, :func:`plain_generate`,
:class:`AcceptanceReport`; the Lightning :class:`AcceptanceCallback` (logs ``val/tau_real``) is imported lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_eagle.inference.acceptance import AcceptanceReport, evaluate_acceptance
from lightning_eagle.inference.aux_ids import resolve_inference_aux
from lightning_eagle.inference.draft_runner import DraftProposal, DraftRunner
from lightning_eagle.inference.incremental_target import IncrementalTarget, TargetStep
from lightning_eagle.inference.plain import PlainOutput, plain_generate
from lightning_eagle.inference.speculative import SpeculativeOutput, speculative_generate

if TYPE_CHECKING:
    from lightning_eagle.inference.callback import AcceptanceCallback

__all__ = [
    "AcceptanceCallback",
    "AcceptanceReport",
    "DraftProposal",
    "DraftRunner",
    "IncrementalTarget",
    "PlainOutput",
    "SpeculativeOutput",
    "TargetStep",
    "evaluate_acceptance",
    "plain_generate",
    "resolve_inference_aux",
    "speculative_generate",
]


def __getattr__(name: str) -> Any:
    if name == "AcceptanceCallback":  # keeps `import lightning_eagle.inference` free of Lightning
        from lightning_eagle.inference.callback import AcceptanceCallback

        return AcceptanceCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
