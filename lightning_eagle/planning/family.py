"""Draft families as the memory plan knows them: one :class:`PlanningFamily` record per family, registered by the
family's name next to its planning code (EAGLE-3: :mod:`lightning_eagle.planning.eagle3_plan`; DSpark:
:mod:`lightning_eagle.planning.dspark_plan`), in a module its
:class:`~lightning_eagle.draft.family.DraftFamily` lists in ``layers``.

The plan's shared code (the inputs, the resident weights, the target's capture, the optimizer step, the fit search,
the printout, reading a run config) looks the family up by name (:func:`planning_family`) and never names one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_eagle.draft.family import LayerRecords

if TYPE_CHECKING:
    from lightning_eagle.parallel.memory import TargetShapes
    from lightning_eagle.planning.census import StepCensus
    from lightning_eagle.planning.draft_shapes import DraftShapes

# A PlanInputs and a Term: the inputs look this record up, so this module imports neither (no cycle between files).
Inputs = Any
Terms = list


def _same_draft(draft: Any, data: Mapping[str, Any]) -> Any:
    return draft


@dataclass(frozen=True)
class PlanningFamily:
    """One draft family as the memory plan knows it.

    ``name``: the family's (its :class:`~lightning_eagle.draft.family.DraftFamily`'s). ``phases``: the phases of one
    training step after the resident weights, in order; the first is
    :data:`~lightning_eagle.planning.terms.TARGET_FORWARD` and the last
    :data:`~lightning_eagle.planning.terms.OPTIMIZER_STEP`, whose terms the shared plan makes.
    ``draft_shapes(config)``: the draft's parameters by role, from the real module built on meta. ``check(inputs)``:
    ``ValueError`` naming the setting the plan does not model for this family. ``step_terms(inputs, target, draft)``:
    the family's own terms (its phases between the target forward and the optimizer step, and any resident term of
    its own). ``describe(inputs)``: the header line naming the micro-batch and the draft's settings.
    ``draft_for_data(draft, data)``: the draft config as the run builds it once the data module (its ``init_args``)
    is known (default: unchanged). ``census(inputs)``: the census of the family's draft step on the meta device at the
    planned shapes (:mod:`lightning_eagle.planning.census`; None: the family's terms are analytic), made once the
    inputs passed their checks and kept in :attr:`PlanInputs.draft_step`.
    """

    name: str
    phases: tuple[str, ...]
    draft_shapes: Callable[[Any], DraftShapes]
    check: Callable[[Inputs], None]
    step_terms: Callable[[Inputs, TargetShapes, DraftShapes], Terms]
    describe: Callable[[Inputs], str]
    draft_for_data: Callable[[Any, Mapping[str, Any]], Any] = _same_draft
    census: Callable[[Inputs], StepCensus] | None = None


PLANNING_FAMILIES = LayerRecords("planning", "memory plan")


def register_planning_family(family: PlanningFamily) -> PlanningFamily:
    """Add ``family`` (its name must be new)."""
    return PLANNING_FAMILIES.register(family.name, family)


def unregister_planning_family(name: str) -> None:
    """Remove a family's record (a test's own family, after the test)."""
    PLANNING_FAMILIES.pop(name, None)


def planning_family(name: str, source: str = "the memory plan") -> PlanningFamily:
    """The planning record of the draft family ``name`` (the family's modules imported first); a family that
    registers none is a ``ValueError`` naming it."""
    return PLANNING_FAMILIES.named(name, source)
