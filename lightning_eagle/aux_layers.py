"""The taps of every draft family: which target layers a draft reads (``aux_layer_ids``, 0-based decoder-layer
outputs) and which AttnRes stream (``aux_stream``), under those two names in settings, draft configs and checkpoints;
the default ids, and the one validation of ids with each family's rules as arguments. Dependency-free on purpose
(parsing a draft config must not import transformers).

Exports keep the field names their readers expect: the stream is ``aux_hidden_state_stream`` in an export's
``config.json`` (`eagle3_training.md` §14, :data:`STREAM_EXPORT_KEY`), a DSpark export's taps vLLM's
``target_layer_ids``; draft configs written before the names were shared (:data:`RENAMED_CONFIG_FIELDS`) are read by
:func:`renamed_fields`.
"""

from __future__ import annotations

from typing import Any

# Which AttnRes stream the taps read: the raw in-block prefix (what the reference and public K3 drafts use) or the mix
# the next layer reads.
AUX_STREAMS = ("prefix", "mixed")
STREAM_EXPORT_KEY = "aux_hidden_state_stream"  # the stream's field in an export's config.json
# draft config fields under the names they had before one name per concept → their name now
RENAMED_CONFIG_FIELDS = {STREAM_EXPORT_KEY: "aux_stream", "target_layer_ids": "aux_layer_ids"}


def renamed_fields(data: dict[str, Any]) -> dict[str, Any]:
    """A draft config's fields (a checkpoint's record, an export's ``config.json``) under the shared names."""
    return {RENAMED_CONFIG_FIELDS.get(k, k) if RENAMED_CONFIG_FIELDS.get(k, k) not in data else k: v
            for k, v in data.items()}  # fmt: skip


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default taps ``[1, L//2 - 1, L - 4]`` (0-based decoder-layer outputs; K3: ``[1, 45, 89]``)."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def resolve_default_aux_layer_ids(num_layers: int) -> list[int]:
    """The default taps, validated: they collide or fall outside a very shallow target, which must pass ids."""
    default = default_aux_layer_ids(num_layers)
    try:
        return validate_aux_layer_ids(default, num_layers)
    except ValueError as err:
        raise ValueError(
            f"the default EAGLE-3 aux_layer_ids [1, L//2-1, L-4] = {default} are invalid for a {num_layers}-layer "
            f"target ({err}); pass aux_layer_ids explicitly (e.g. [1, {max(num_layers // 2, 2)}, {num_layers - 1}] "
            "for k3-tiny: [1, 3, 5])"
        ) from None


def resolve_aux_layer_ids(aux_layer_ids, num_hidden_layers: int) -> list[int]:
    """Explicit ids validated, or (None) the default taps, validated."""
    if aux_layer_ids is None:
        return resolve_default_aux_layer_ids(num_hidden_layers)
    return validate_aux_layer_ids(aux_layer_ids, num_hidden_layers)


def validate_aux_layer_ids(
    aux_layer_ids,
    num_hidden_layers: int | None,
    count: int | None = 3,
    *,
    ascending: bool = False,
    final: bool = True,
    why: dict[str, str] | None = None,
) -> list[int]:
    """The one check of a draft's taps, every family's rules as arguments: ``count`` ids exactly (None: one or more),
    distinct ints in ``[0, L]`` (``final=False``: ``[0, L - 1]``, the pre-norm final state ``L`` not a tap),
    strictly ``ascending`` when the family's engine sorts them; else the order is kept (it is the draft's input
    order). ``why`` adds a family's reason to the problem of a rule (``"count"``, ``"range"``, ``"ascending"``).
    ``num_hidden_layers=None`` (depth unknown) skips the range."""
    L, why = num_hidden_layers, why or {}
    ids = list(aux_layer_ids) if isinstance(aux_layer_ids, (list, tuple)) else aux_layer_ids
    if not isinstance(ids, list):
        raise ValueError(f"aux_layer_ids must be a list of layer ids, got {aux_layer_ids!r}")
    problems = []
    if count is not None and len(ids) != count:
        problems.append(f"expected {count} ids, got {len(ids)}" + _because(why.get("count")))
    elif not ids:
        problems.append("expected at least one id" + _because(why.get("count")))
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        problems.append("ids must be ints")
    elif L is not None and any(not 0 <= i <= (L if final else L - 1) for i in ids):
        top = L if final else L - 1
        outside = [i for i in ids if not 0 <= i <= top]
        meaning = f"{L} = input of the final norm" if final else f"{L}, the pre-norm final state, is not a tap"
        reason = _because(why.get("range"), "; ")
        problems.append(f"ids must be in [0, {top}] (num_hidden_layers={L}; {meaning}{reason}); outside: {outside}")
    if len(set(ids)) != len(ids):
        problems.append("ids must be distinct")
    elif ascending and ids != sorted(ids):
        problems.append("ids must be ascending" + _because(why.get("ascending")))
    if problems:
        target = f"a {L}-layer target" if L is not None else "a target of unknown depth"
        raise ValueError(f"invalid aux_layer_ids {ids} for {target}: " + "; ".join(problems))
    return ids


def _because(reason: str | None, joiner: str = ": ") -> str:
    return f"{joiner}{reason}" if reason else ""
