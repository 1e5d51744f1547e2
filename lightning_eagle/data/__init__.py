"""Chat data for K3 drafts (either family): tokenizer, K3/K2 rendering, loss-mask recovery, vocab map, DataModule.

``import lightning_eagle.data`` stays light (no Lightning import); ``ChatDataModule`` is loaded on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_eagle.data.final_norm import (
    FINAL_NORM_TYPES,
    FinalNorm,
    apply_final_norm,
    build_final_norm,
    load_final_norm_weight,
    select_final_norm_type,
)
from lightning_eagle.data.loss_mask import (
    LossMaskRecovery,
    get_loss_mask_recovery,
    get_loss_mask_recovery_by_name,
    has_all_tokens,
    register_loss_mask_recovery,
    registered_loss_mask_recoveries,
)
from lightning_eagle.data.render_k2 import build_k2_segments, render_k2_chat
from lightning_eagle.data.render_k3 import (
    ChatFormatError,
    Segment,
    build_k3_segments,
    render_k3_chat,
    render_k3_chat_with_assistant_mask,
    render_k3_text,
)
from lightning_eagle.data.rows import DataRowError
from lightning_eagle.data.synthetic_corpus import bundled_sample_path, generate_synthetic_corpus
from lightning_eagle.data.synthetic_tokenizer import synthetic_k2_tokenizer, synthetic_k3_tokenizer
from lightning_eagle.data.tokenizer import KimiTokenizer
from lightning_eagle.data.tokenizer_files import load_kimi_tokenizer
from lightning_eagle.data.vocab_map import VocabMapping, build_vocab_mapping, count_supervised_tokens

if TYPE_CHECKING:
    from lightning_eagle.data.datamodule import ChatDataModule

__all__ = [
    "FINAL_NORM_TYPES",
    "ChatDataModule",
    "ChatFormatError",
    "DataRowError",
    "FinalNorm",
    "KimiTokenizer",
    "LossMaskRecovery",
    "Segment",
    "VocabMapping",
    "apply_final_norm",
    "build_final_norm",
    "build_k2_segments",
    "build_k3_segments",
    "build_vocab_mapping",
    "bundled_sample_path",
    "count_supervised_tokens",
    "generate_synthetic_corpus",
    "get_loss_mask_recovery",
    "get_loss_mask_recovery_by_name",
    "has_all_tokens",
    "load_final_norm_weight",
    "load_kimi_tokenizer",
    "register_loss_mask_recovery",
    "registered_loss_mask_recoveries",
    "render_k2_chat",
    "render_k3_chat",
    "render_k3_chat_with_assistant_mask",
    "render_k3_text",
    "select_final_norm_type",
    "synthetic_k2_tokenizer",
    "synthetic_k3_tokenizer",
]


def __getattr__(name: str) -> Any:
    if name == "ChatDataModule":
        from lightning_eagle.data.datamodule import ChatDataModule

        return ChatDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
