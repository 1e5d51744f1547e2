"""lightning_eagle: train speculative-decoding drafts for a frozen Kimi K3 target with PyTorch Lightning, in two draft
families: EAGLE-3 (chains, :class:`Eagle3Module`) and DSpark (blocks, :class:`DSparkModule`). Each family is selected
by ``model.class_path`` when training and by its checkpoint and export afterwards.

Data flow: ``data`` (chats → tokens + loss masks + vocab map) → ``k3`` (frozen K3, aux hidden states, teacher
hidden) → ``draft`` (the drafts of both families: the NoPE-MLA gated EAGLE-3 layer, the DSpark block drafter) →
``training`` (each family's objective, metrics and LightningModule; placement asked of ``parallel``: expert-parallel
strategy, layout gates) → ``commands`` (every command line); a run's settings are the typed groups of
:mod:`lightning_eagle.run_settings`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Lazy exports keep `import lightning_eagle` cheap (Lightning and transformers cost seconds to import).
_EXPORTS = {
    "KimiK3Config": "lightning_eagle.k3.config",
    "KimiK3TextConfig": "lightning_eagle.k3.config",
    "KimiK3ForCausalLM": "lightning_eagle.k3.model",
    "config_from_name": "lightning_eagle.k3.presets",
    "KimiK3Eagle3Draft": "lightning_eagle.draft",
    "export_draft": "lightning_eagle.draft",
    "Eagle3Module": "lightning_eagle.training.module",
    "DSparkModule": "lightning_eagle.training.dspark_module",
    "ChatDataModule": "lightning_eagle.data.datamodule",
    "ExpertParallelStrategy": "lightning_eagle.parallel.strategy",
    "ParallelLayout": "lightning_eagle.parallel.layout",
    "TargetSettings": "lightning_eagle.run_settings",
    "DraftSettings": "lightning_eagle.run_settings",
    "ObjectiveSettings": "lightning_eagle.run_settings",
    "OptimizationSettings": "lightning_eagle.run_settings",
    "DSparkDraftSettings": "lightning_eagle.training.dspark_settings",
    "DSparkObjectiveSettings": "lightning_eagle.training.dspark_settings",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover — what IDEs and type checkers see; a test keeps it equal to _EXPORTS
    from lightning_eagle.data.datamodule import ChatDataModule
    from lightning_eagle.draft import KimiK3Eagle3Draft, export_draft
    from lightning_eagle.k3.config import KimiK3Config, KimiK3TextConfig
    from lightning_eagle.k3.model import KimiK3ForCausalLM
    from lightning_eagle.k3.presets import config_from_name
    from lightning_eagle.parallel.layout import ParallelLayout
    from lightning_eagle.parallel.strategy import ExpertParallelStrategy
    from lightning_eagle.run_settings import DraftSettings, ObjectiveSettings, OptimizationSettings, TargetSettings
    from lightning_eagle.training.dspark_module import DSparkModule
    from lightning_eagle.training.dspark_settings import DSparkDraftSettings, DSparkObjectiveSettings
    from lightning_eagle.training.module import Eagle3Module


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lightning_eagle' has no attribute {name!r}")
