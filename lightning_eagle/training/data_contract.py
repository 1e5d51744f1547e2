"""What a draft-training module asks of the run's data module, declared (any ``LightningDataModule`` that has these
members takes part; one without them is simply not asked):

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


def features_manifest(trainer) -> dict[str, Any] | None:
    """The manifest of the run's dumped features (None when the data module holds chats, or outside a trainer)."""
    datamodule = run_datamodule(trainer)
    return datamodule.manifest if isinstance(datamodule, DumpedFeatures) else None


def vocab_mapping(trainer, target_vocab_size: int):
    """The data module's draft vocabulary map (None when it has none), its tokenizer checked against the target's
    vocabulary."""
    datamodule = run_datamodule(trainer)
    if not isinstance(datamodule, DraftVocabulary):
        return None
    vocab = datamodule.vocab_size
    if vocab is not None and vocab != target_vocab_size:
        raise ValueError(
            f"the data's tokenizer has {vocab} ids but the target's vocab_size is {target_vocab_size}: tokenizer and "
            "target checkpoint do not belong together"
        )
    return datamodule.vocab_mapping
