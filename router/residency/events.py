"""What the residency loop takes in and what it writes down.

In: typed happenings, each applied on the loop (`ResidencyController.apply`): a node's report, a
node lost, an instance's death, and the outcomes of the effects it started (a load done or
failed, a stop's release or its end, a copy of weights done). Out: `ClusterEvent`, one line of the log that
GET /v1/cluster/events, the metrics and the operator's store read."""

from typing import Literal

from pydantic import Field

from cluster.node_report import StoreReport
from deployments.wire.events import ClusterEvent, EventKind
from deployments.wire.measured import MeasuredMemory
from deployments.wire.reports import Released
from policy import InstanceRef, Place
from policy._frozen import Frozen
from policy.cluster_state import LoadFailureReason
from policy.specs import DeviceKind

__all__ = ["ClusterEvent", "EventKind"]


# ---- happenings the loop applies ------------------------------------------------------------
class NodeReported(Frozen):
    """A node agent's measurement. `asked_at`: when the report was asked for (the loop's clock;
    None: now)."""

    node_id: str
    devices: tuple[DeviceKind, ...]
    total_bytes: int
    usable_bytes: int
    free_bytes: int
    labels: dict[str, str] = Field(default_factory=dict)
    stored: frozenset[str] | None = None  # without a store report (the loop's tests); else read from `store`
    asked_at: float | None = None
    ray_node_id: str | None = None
    chip: str | None = None
    store: StoreReport | None = None  # its model store, when it has one
    # what the state counted as ours on the node when the report was asked for (controller.held_bytes):
    # foreign memory is what the measurement shows beside that, not beside what changed since
    ours_bytes: int | None = None


class CachesReported(Frozen):
    """What the kept prompt prefixes of a node's ready instances hold now, by model, as their memory
    reports said (`MemoryReport.prefix_cache_bytes`, X4); a model not named is left as it was."""

    node_id: str
    prefix_cache_bytes: dict[str, int] = Field(default_factory=dict)
    # ... and what prefilling them again would take (`MemoryReport.prefix_prefill_s`, E3), by model
    prefix_reload_s: dict[str, float] = Field(default_factory=dict)
    # ... and what an engine measured once idle after its load (`MemoryReport.measured`, M1), by model
    measured: dict[str, MeasuredMemory] = Field(default_factory=dict)


class NodeLost(Frozen):
    """A node that died (Ray says so), or that is suspect: its agent or an actor there stopped
    answering. Either way its instances are dropped and placements avoid it until it reports again."""

    node_id: str
    reason: str
    suspect: bool = False


class InstanceDied(Frozen):
    instance: InstanceRef
    cause: str


class LoadDone(Frozen):
    place: Place
    bytes: int = Field(ge=0)  # measured: weights + KV reservation + overhead
    load_seconds: float = Field(ge=0)


class LoadFailed(Frozen):
    place: Place
    attempt: int
    reason: LoadFailureReason | Literal["no_room", "node_lost", "cancelled"]
    message: str


class StopDone(Frozen):
    stop_id: int
    instance: InstanceRef
    gone: bool  # its process exited (or none was started); False: the exit was not confirmed
    reason: str
    bytes: int | None = None  # what it released, when a process may have run
    spare: bool = False  # its process did not exit: it is its node's spare now (R1)


class StopReleased(Frozen):
    """A stopping instance's model server stopped its engine and gave its model's memory back in its
    process (rule X1); its process still holds `released.held_bytes` until it exits (StopDone)."""

    stop_id: int
    instance: InstanceRef
    released: Released
    reason: str


class FetchDone(Frozen):
    """A copy of weights into a node's store ended; `failure` says why not. `purpose`: before an
    evicting placement (L1), right before a load that evicted nothing (L1), a background copy (L4),
    or an operator's pull."""

    model: str
    node_id: str
    purpose: Literal["placement", "background", "pull", "load"] = "placement"
    failure: LoadFailureReason | None = None
    message: str = ""


# ---- what effects answer --------------------------------------------------------------------
class LoadResult(Frozen):
    bytes: int = Field(ge=0)  # measured: weights + KV reservation + overhead
    load_seconds: float = Field(ge=0)
    measured: MeasuredMemory | None = None  # what the engine measured after its load (M1)


class LoadError(Exception):
    """A start or a fetch that did not end in a loaded instance or stored weights."""

    def __init__(self, reason: LoadFailureReason, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


class NodeUnreachable(Exception):
    """An effect could not reach its node (Ray cannot schedule there, its agent does not answer):
    the node is suspect, not the model."""

    def __init__(self, node_id: str, message: str):
        super().__init__(message)
        self.node_id = node_id
        self.message = message
