"""What the policy answers. The HTTP layer turns Reject/Wait into a 503 (or 404) verbatim."""

from typing import Literal

from pydantic import Field

from policy._frozen import Frozen
from policy.cluster_state import InstanceRef, LoadFailureReason
from policy.specs import DeviceKind

Protection = Literal["pinned", "min_copies", "busy", "loading", "draining", "young"]
# Protections that end by themselves: waiting for them may help.
PASSING_PROTECTIONS: frozenset[str] = frozenset({"busy", "loading", "draining", "young"})


class Blocker(Frozen):
    """An instance that stands in the way and why it may not be evicted."""

    instance: InstanceRef
    protection: Protection
    bytes: int


class Use(Frozen):
    decision: Literal["use"] = "use"
    instance: InstanceRef


class Place(Frozen):
    """Load `model` on `node_id` after unloading `evict` (in order)."""

    decision: Literal["place"] = "place"
    model: str
    node_id: str
    device: DeviceKind
    bytes: int
    evict: tuple[InstanceRef, ...] = ()
    reason: str = ""


RejectCode = Literal[
    "unknown_model",  # 404
    "no_eligible_node",  # no alive node meets the model's constraints
    "too_large",  # larger than what any eligible node can ever give
    "blocked",  # pinned models or caps stand in the way; waiting cannot help
    "busy",  # busy/young/loading instances stand in the way and we do not (or no longer) wait
    "load_failed",
    "no_node",  # an operator's load on a node that is not there or not alive (P11)
    "max_copies",  # an operator's load of another copy beyond max_copies (P11)
]


class Reject(Frozen):
    decision: Literal["reject"] = "reject"
    model: str
    code: RejectCode
    message: str
    blockers: tuple[Blocker, ...] = ()
    # Set when asking again later may succeed (HTTP Retry-After).
    retry_after_s: float | None = None


class Wait(Frozen):
    """Ask again after retry_after_s: the model is loading, or what blocks it will pass."""

    decision: Literal["wait"] = "wait"
    model: str
    code: Literal["loading", "busy"]
    message: str
    blockers: tuple[Blocker, ...] = ()
    retry_after_s: float = Field(gt=0)


class Unload(Frozen):
    """A sweep result: unload this instance."""

    instance: InstanceRef
    reason: Literal["idle", "draining", "node_dead"]


class LoadFailure(Frozen):
    """Reported by the controller when a Place did not end in a loaded instance (rule P9).
    `reason`: see LoadFailureReason; `attempt`: 1 for the first load, 2 for its retry."""

    model: str
    node_id: str
    reason: LoadFailureReason
    message: str = ""
    attempt: int = Field(default=1, ge=1)


Decision = Use | Place | Wait | Reject
