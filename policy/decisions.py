"""What the policy answers. The HTTP layer turns Reject/Wait into a 503 (or 404) verbatim."""

from collections.abc import Iterator
from typing import Any, Literal

from pydantic import Field, model_validator

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


class Blockers(Frozen):
    """The protected instances a refusal names, in its order, as columns: the i-th blocker is
    (node_ids[i], models[i]) with protections[i], holding bytes[i]. At scale a refusal names a
    thousand, and a pydantic Blocker (with its InstanceRef) for each was most of what deciding it
    cost; a caller that reads them one by one gets Blockers by iterating or indexing, built as read."""

    node_ids: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    protections: tuple[Protection, ...] = ()
    bytes: tuple[int, ...] = ()

    @model_validator(mode="after")
    def _same_lengths(self) -> "Blockers":
        if not len(self.node_ids) == len(self.models) == len(self.protections) == len(self.bytes):
            raise ValueError("node_ids, models, protections and bytes must have one entry per blocker")
        return self

    @model_validator(mode="before")
    @classmethod
    def _from_rows(cls, data: Any) -> Any:
        """A sequence of Blockers (or of their dicts) reads as its columns: a refusal with a few
        blockers may be written that way."""
        if not isinstance(data, tuple | list):
            return data
        rows = [b if isinstance(b, Blocker) else Blocker.model_validate(b) for b in data]
        return {
            "node_ids": tuple(b.instance.node_id for b in rows),
            "models": tuple(b.instance.model for b in rows),
            "protections": tuple(b.protection for b in rows),
            "bytes": tuple(b.bytes for b in rows),
        }

    def __len__(self) -> int:
        return len(self.models)

    def __getitem__(self, index: int) -> Blocker:
        return Blocker(
            instance=InstanceRef(node_id=self.node_ids[index], model=self.models[index]),
            protection=self.protections[index],
            bytes=self.bytes[index],
        )

    # Iterating gives the blockers, as a tuple of them would (a pydantic model iterates over its
    # fields; model_dump gives the columns).
    def __iter__(self) -> Iterator[Blocker]:  # type: ignore[override]
        for index in range(len(self.models)):
            yield self[index]

    def keys_of(self, protection: Protection) -> list[tuple[str, str]]:
        """(node_id, model) of the blockers with this protection, in order, without building a
        Blocker for each."""
        return [(n, m) for n, m, p in zip(self.node_ids, self.models, self.protections, strict=True) if p == protection]


class Use(Frozen):
    decision: Literal["use"] = "use"
    instance: InstanceRef


class Place(Frozen):
    """Load `model` on `node_id` after unloading `evict` (in order) and, when the node is short as it
    is, asking the instances in `shrink` (its other ready ones with kept prompt prefixes) to give
    their prefix caches back (rule X4)."""

    decision: Literal["place"] = "place"
    model: str
    node_id: str
    device: DeviceKind
    bytes: int
    evict: tuple[InstanceRef, ...] = ()
    shrink: tuple[InstanceRef, ...] = ()
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
    blockers: Blockers = Blockers()
    # Set when asking again later may succeed (HTTP Retry-After).
    retry_after_s: float | None = None


class Wait(Frozen):
    """Ask again after retry_after_s: the model is loading, or what blocks it will pass."""

    decision: Literal["wait"] = "wait"
    model: str
    code: Literal["loading", "busy"]
    message: str
    blockers: Blockers = Blockers()
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
