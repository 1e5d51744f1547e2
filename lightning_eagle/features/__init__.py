"""Offline target features: dump the frozen K3's tapped states and final hidden once (``cli.py dump``), then train
drafts of either family from them without the target (``HiddenStateDataModule`` + the family's module with
``model.target.source: features``)."""

from lightning_eagle.features.datamodule import HiddenStateDataModule
from lightning_eagle.features.teacher_head import TeacherHead

__all__ = ["HiddenStateDataModule", "TeacherHead"]
