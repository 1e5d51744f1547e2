"""Small numeric building blocks shared by the K3 target and the drafts."""

from lightning_eagle.ops.norm import K3RMSNorm, rms_norm
from lightning_eagle.ops.situ import SituMLP, situ_and_mul

__all__ = ["K3RMSNorm", "rms_norm", "SituMLP", "situ_and_mul"]
