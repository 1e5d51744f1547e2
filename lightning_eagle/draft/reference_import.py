"""Import a K3 draft exported by NVIDIA-NeMo/Automodel (``KimiK3Eagle3DraftModel``; users migrate from it).

Its layout: ``config.json`` = the *target* text config plus ``draft_vocab_size``, ``target_hidden_size``, ``fc_norm``,
``norm_output`` (``architectures ["LlamaEagle3DraftModel"]``, ``num_hidden_layers`` = the target's); weights
``model.embed_tokens.weight``, ``model.fc.weight``, ``model.fc_norm.{i}.weight``, ``model.layers.0.*``,
``model.norm.weight``, ``lm_head.weight`` and — only with a compressed vocabulary — ``d2t`` / ``t2d``.

Vocabulary order (decision, §9): the reference keeps its draft vocabulary in *frequency* order (``d2t`` may be
negative; ``lm_head`` row i ↔ target id ``i + d2t[i]``), while this library keeps it ascending so that the ``d2t``
order, the ``t2d`` boolean order and the teacher's column order agree. The import therefore sorts the draft
vocabulary: ``lm_head`` rows and ``d2t`` are permuted together by ``argsort(i + d2t[i])``. Every target-id-space
quantity (which target token each logit scores, losses, greedy tokens) is unchanged; only draft ids are renumbered.

The reference config does not record which aux layers/stream the draft was trained on, so ``aux_layer_ids`` and
``aux_stream`` are ``None`` on the imported config (re-export must supply them).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lightning_eagle.draft.config import FIELDS_FROM_TARGET, Eagle3DraftConfig
from lightning_eagle.text_config import text_config_of

_RENAMES = (("model.layers.0.", "midlayer."), ("model.", ""))
# Field types are strings (postponed annotations): ``int | None`` etc. may be null, ``bool`` fields are flags.
_FIELD_TYPES = {f.name: str(f.type) for f in dataclasses.fields(Eagle3DraftConfig)}
NULLABLE_FIELDS = frozenset(name for name, kind in _FIELD_TYPES.items() if "None" in kind.split(" | "))
FLAG_FIELDS = frozenset(name for name, kind in _FIELD_TYPES.items() if kind == "bool")


def is_reference_layout(keys) -> bool:
    return any(k.startswith("model.layers.0.") for k in keys)


def config_from_reference(data: dict[str, Any]) -> Eagle3DraftConfig:
    """Draft config from the reference's ``config.json`` (target text config + draft fields).

    Per field: present with a value → that value; present with null → null (:func:`reference_value`); absent → the
    reference's default. For the target fields that is the published K3 value (``Eagle3DraftConfig``'s default): the
    reference's ``KimiK3TextConfig`` defaults agree for the MLA / SiTU / eps fields (q_lora_rank 1536, kv_lora_rank
    512, SiTU betas 4.0 / 25.0, rms_norm_eps 1e-5, …), and where they do not they are known to be wrong (HEAD's 56
    heads / 18432 MLP, token ids 1/2/0; `k3_target.md` §1.1, §1.4), so the published values win there too.
    """
    text = text_config_of(data)
    values = {name: reference_value(name, text[name]) for name in FIELDS_FROM_TARGET if name in text}
    if "num_aux_hidden_states" in text:  # absent → 3, as the reference's getattr(config, name, 3)
        values["num_aux_hidden_states"] = reference_value("num_aux_hidden_states", text["num_aux_hidden_states"])
    values.update(
        # Absent → the reference's getattr defaults: draft_vocab_size → vocab_size (the identity map, not our 32000),
        # target_hidden_size → hidden_size. Null → None, which our config resolves the same way (§9).
        draft_vocab_size=reference_value("draft_vocab_size", text.get("draft_vocab_size")),
        target_hidden_size=reference_value("target_hidden_size", text.get("target_hidden_size")),
        # The reference writes the target's depth; the draft's own is always 1.
        target_num_hidden_layers=reference_value("target_num_hidden_layers", text.get("num_hidden_layers")),
        # Absent or null → off: the reference reads both as getattr(config, name, False) by truthiness.
        fc_norm=reference_value("fc_norm", text.get("fc_norm")),
        norm_output=reference_value("norm_output", text.get("norm_output")),
        aux_layer_ids=None,
        aux_stream=None,
    )
    return Eagle3DraftConfig(**values)


def reference_value(name: str, value: Any) -> Any:
    """A reference ``config.json`` value for :class:`Eagle3DraftConfig` field ``name``; null is never "our default".

    Nullable fields (``q_lora_rank`` → a plain ``q_proj``, SiTU betas → no cap, token ids, …) keep None. A null flag
    means off: the reference tests its flags by truthiness. Null anywhere else has no meaning, so it is refused
    instead of being replaced by a default that may build a different draft.
    """
    if value is not None or name in NULLABLE_FIELDS:
        return value
    if name in FLAG_FIELDS:
        return False
    raise ValueError(f"reference config.json: {name} is null, but a K3 draft needs a value for it")


def reference_vocab_permutation(d2t: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """``perm`` such that ``selected[perm]`` is ascending, after checking the reference map is a valid one."""
    selected = torch.arange(d2t.numel()) + d2t.to(torch.long)
    if selected.numel() and (selected.min() < 0 or selected.max() >= t2d.numel()):
        raise ValueError("reference d2t maps draft ids outside the target vocabulary")
    perm = torch.argsort(selected, stable=True)
    ascending = selected[perm]
    if selected.numel() > 1 and not bool((ascending[1:] > ascending[:-1]).all()):
        raise ValueError("reference d2t maps two draft ids to the same target id")
    if not torch.equal(torch.nonzero(t2d).flatten(), ascending):
        raise ValueError("reference d2t and t2d disagree: t2d must mark exactly the target ids arange + d2t")
    return perm


def convert_reference_state(state: dict[str, torch.Tensor], config: Eagle3DraftConfig) -> dict[str, torch.Tensor]:
    """Rename to our layout and sort the draft vocabulary ascending (lm_head rows and d2t together)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        new = key
        for old, repl in _RENAMES:
            if new.startswith(old):
                new = repl + new[len(old) :]
                break
        out[new] = value
    return sort_vocabulary(out, config)


def sort_vocabulary(state: dict[str, torch.Tensor], config: Eagle3DraftConfig) -> dict[str, torch.Tensor]:
    """Our vocabulary order on a foreign state (this import's and the engine format's): ``d2t``/``t2d`` added for an
    identity vocabulary that omits them, a missing ``t2d`` rebuilt from ``d2t`` (engines ignore it), and the draft
    vocabulary sorted ascending (``lm_head`` rows and ``d2t`` permuted together, §9)."""
    out = dict(state)
    if "d2t" not in out and "t2d" not in out and not config.has_vocab_compression:
        # The reference writes the buffers only with a compressed vocabulary; ours are always present (§9).
        out["d2t"] = torch.zeros(config.vocab_size, dtype=torch.long)
        out["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    if "d2t" in out and "t2d" not in out:
        selected = torch.arange(out["d2t"].numel()) + out["d2t"].cpu().to(torch.long)
        if selected.numel() and (selected.min() < 0 or selected.max() >= config.vocab_size):
            raise ValueError("d2t maps draft ids outside the target vocabulary")
        out["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool).index_fill_(0, selected, True)
    if "d2t" in out and "t2d" in out and "lm_head.weight" in out:
        perm = reference_vocab_permutation(out["d2t"].cpu(), out["t2d"].cpu().to(torch.bool))
        selected = torch.arange(perm.numel()) + out["d2t"].cpu().to(torch.long)
        out["lm_head.weight"] = out["lm_head.weight"][perm.to(out["lm_head.weight"].device)]
        out["d2t"] = (selected[perm] - torch.arange(perm.numel())).to(out["d2t"].device)
    return out
