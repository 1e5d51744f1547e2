"""Speculative-decoding inference for K3 drafts of both families: incremental target, draft runner, lossless loops
(EAGLE-3 chains, DSpark blocks), acceptance. A draft's family is read from its export.

Public API (stable): :func:`speculative_generate`, :func:`evaluate_acceptance`, :func:`evaluate_prompt_set` (a
standard prompt set decoded turn by turn; both decode with the loop of the draft's family, as one
:class:`DecodingSettings` says), and for DSpark drafters :func:`block_speculative_generate`. Building blocks for
notebooks and research: :class:`IncrementalTarget` (prefill/extend/rollback), :class:`DraftRunner`,
:func:`plain_generate`, :class:`AcceptanceReport`; the Lightning :class:`AcceptanceCallback` (logs ``val/tau_real``).
Every name is imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Lazy: `import lightning_eagle.inference` loads no model code and no Lightning until a name is used.
_EXPORTS = {
    "AcceptanceCallback": "lightning_eagle.inference.callback",
    "AcceptanceReport": "lightning_eagle.inference.acceptance",
    "evaluate_acceptance": "lightning_eagle.inference.acceptance",
    "block_speculative_generate": "lightning_eagle.inference.block_speculative",
    "DecodingSettings": "lightning_eagle.inference.decoding_settings",
    "resolve_inference_aux": "lightning_eagle.inference.aux_ids",
    "DraftProposal": "lightning_eagle.inference.drafter",
    "Drafter": "lightning_eagle.inference.drafter",
    "DraftRunner": "lightning_eagle.inference.draft_runner",
    "IncrementalTarget": "lightning_eagle.inference.incremental_target",
    "TargetStep": "lightning_eagle.inference.incremental_target",
    "PlainOutput": "lightning_eagle.inference.plain",
    "evaluate_prompt_set": "lightning_eagle.inference.prompt_set_run",
    "plain_generate": "lightning_eagle.inference.plain",
    "SpeculativeOutput": "lightning_eagle.inference.speculative",
    "speculative_generate": "lightning_eagle.inference.speculative",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover — what IDEs and type checkers see; keep it equal to _EXPORTS
    from lightning_eagle.inference.acceptance import AcceptanceReport, evaluate_acceptance
    from lightning_eagle.inference.aux_ids import resolve_inference_aux
    from lightning_eagle.inference.block_speculative import block_speculative_generate
    from lightning_eagle.inference.callback import AcceptanceCallback
    from lightning_eagle.inference.decoding_settings import DecodingSettings
    from lightning_eagle.inference.draft_runner import DraftRunner
    from lightning_eagle.inference.drafter import Drafter, DraftProposal
    from lightning_eagle.inference.incremental_target import IncrementalTarget, TargetStep
    from lightning_eagle.inference.plain import PlainOutput, plain_generate
    from lightning_eagle.inference.prompt_set_run import evaluate_prompt_set
    from lightning_eagle.inference.speculative import SpeculativeOutput, speculative_generate


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
