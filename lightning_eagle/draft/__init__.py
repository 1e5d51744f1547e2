"""The K3 EAGLE-3 draft: config, model (K3-faithful or the served deepseek_mla variant), TTT attention backends,
serving export and import."""

from lightning_eagle.draft.cache import TTTCache
from lightning_eagle.draft.config import Eagle3DraftConfig
from lightning_eagle.draft.deepseek_mla import DeepseekMLAEagle3Draft  # registers its architecture for build_draft
from lightning_eagle.draft.export import export_draft
from lightning_eagle.draft.model import KimiK3Eagle3Draft, build_draft
from lightning_eagle.draft.ttt_attention import get_ttt_attention, register_ttt_attention, ttt_attention_backends

__all__ = [
    "DeepseekMLAEagle3Draft",
    "Eagle3DraftConfig",
    "KimiK3Eagle3Draft",
    "TTTCache",
    "build_draft",
    "export_draft",
    "get_ttt_attention",
    "register_ttt_attention",
    "ttt_attention_backends",
]
