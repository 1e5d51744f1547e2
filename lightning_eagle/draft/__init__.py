"""The K3 drafts of both families: the EAGLE-3 draft (config, model: K3-faithful or the served deepseek_mla variant,
TTT attention backends, serving export and import) and the DSpark block drafter (config, model, vLLM export)."""

from lightning_eagle.draft.cache import TTTCache
from lightning_eagle.draft.config import Eagle3DraftConfig
from lightning_eagle.draft.deepseek_mla import DeepseekMLAEagle3Draft  # registers its architecture for build_draft
from lightning_eagle.draft.dspark import DSparkContextCache, DSparkDrafter
from lightning_eagle.draft.dspark_config import DSparkDraftConfig, dspark_config_from_preset
from lightning_eagle.draft.dspark_export import dspark_serving_command, export_dspark_draft, load_dspark_export
from lightning_eagle.draft.export import export_draft
from lightning_eagle.draft.model import KimiK3Eagle3Draft, build_draft
from lightning_eagle.draft.ttt_attention import get_ttt_attention, register_ttt_attention, ttt_attention_backends

__all__ = [
    "DSparkContextCache",
    "DSparkDraftConfig",
    "DSparkDrafter",
    "DeepseekMLAEagle3Draft",
    "Eagle3DraftConfig",
    "KimiK3Eagle3Draft",
    "TTTCache",
    "build_draft",
    "dspark_config_from_preset",
    "dspark_serving_command",
    "export_dspark_draft",
    "export_draft",
    "get_ttt_attention",
    "load_dspark_export",
    "register_ttt_attention",
    "ttt_attention_backends",
]
