"""Which target layers EAGLE-3 taps: the default ids and the one validation of ``aux_layer_ids``, shared by the K3
target, the draft config and inference. Dependency-free on purpose (parsing a draft config must not import
transformers)."""

from __future__ import annotations

# Which AttnRes stream the taps read: the raw in-block prefix (what the reference and public K3 drafts use) or the mix
# the next layer reads.
AUX_STREAMS = ("prefix", "mixed")


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


def validate_aux_layer_ids(aux_layer_ids, num_hidden_layers: int | None, count: int | None = 3) -> list[int]:
    """Exactly ``count`` distinct ids in ``[0, L]``; order is kept (it is ``fc``'s input order). The one check used
    by the target, the draft config and inference; ``num_hidden_layers=None`` (depth unknown) skips the range."""
    L = num_hidden_layers
    ids = list(aux_layer_ids)
    problems = []
    if count is not None and len(ids) != count:
        problems.append(f"expected {count} ids (EAGLE-3 needs exactly {count}), got {len(ids)}")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        problems.append("ids must be ints")
    elif L is not None and any(not 0 <= i <= L for i in ids):
        outside = [i for i in ids if not 0 <= i <= L]
        problems.append(
            f"ids must be in [0, {L}] (num_hidden_layers={L}; {L} = input of the final norm); outside: {outside}"
        )
    if len(set(ids)) != len(ids):
        problems.append("ids must be distinct")
    if problems:
        target = f"a {L}-layer target" if L is not None else "a target of unknown depth"
        family = "EAGLE-3 " if count == 3 else ""  # count None: a drafter of any tap count (DSpark)
        raise ValueError(f"invalid {family}aux_layer_ids {ids} for {target}: " + "; ".join(problems))
    return ids
