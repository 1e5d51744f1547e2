"""What ``Eagle3Module`` asks of the run's data module, declared (any ``LightningDataModule`` that has these members
takes part; one without them is simply not asked):

* :class:`DraftVocabulary`: ``vocab_mapping`` (the draft's ``d2t``/``t2d``, None before ``setup``) and ``vocab_size``
  (the tokenizer's, checked against the target's) — ``ChatDataModule`` and ``HiddenStateDataModule``;
* :class:`DumpedFeatures`: ``manifest`` of a features folder (offline training) — ``HiddenStateDataModule``;
* :class:`FixedBatchSize`: ``batch_size`` (resume across world sizes rescales the loop counters with it).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class DraftVocabulary(Protocol):
    vocab_mapping: Any
    vocab_size: int


@runtime_checkable
class DumpedFeatures(Protocol):
    manifest: dict[str, Any]


@runtime_checkable
class FixedBatchSize(Protocol):
    batch_size: int


def run_datamodule(trainer) -> Any:
    """The trainer's data module (None outside a trainer or without one)."""
    return trainer.datamodule if trainer is not None else None
