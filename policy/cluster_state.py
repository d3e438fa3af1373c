"""A snapshot of the cluster as the controller sees it: nodes, what they report, what they hold."""

from typing import Literal

from pydantic import Field, model_validator

from policy._frozen import Frozen
from policy.specs import DeviceKind, ModelSpec

InstanceStatus = Literal["loading", "ready", "draining"]
FetchSource = Literal["peer", "hub"]
# Why a load did not end in a loaded instance (rule P9). Only out_of_memory may be cured by more
# memory; the others are not retried by evicting.
#   not_found:     the model's files (or folder) are missing
#   bad_files:     the files are there but unusable: truncated or corrupt weights, a bad config, an
#                  unsupported format or architecture
#   out_of_memory: the load ran out of memory (the only reason that earns evict-and-retry)
#   error:         any other load error (not an out-of-memory)
LoadFailureReason = Literal["not_found", "bad_files", "out_of_memory", "error"]


# (node_id, model): an InstanceRef's identity as a plain tuple. Sets the policy builds for one
# decision (the members of a cap, the victims chosen) hold these: hashed and compared in C, where a
# pydantic InstanceRef costs microseconds to build and to compare, a thousand times per decision.
RefKey = tuple[str, str]


class InstanceRef(Frozen):
    """Names one instance. A node holds at most one instance of a model; copies live on other nodes."""

    node_id: str
    model: str

    def __str__(self) -> str:
        return f"{self.model}@{self.node_id}"


class InstanceState(Frozen):
    """One loaded (or loading, or draining) model instance on a node."""

    model: str
    device: DeviceKind
    # What the instance holds or has reserved: weights + KV reservation + overhead, as measured once
    # loaded, as planned while loading.
    bytes: int = Field(ge=0)
    # What its kept prompt prefixes hold now (an LLM's prefix cache, at most its engine's
    # prompt_cache_bytes), as its last memory report said: memory the instance holds on its node
    # beside `bytes`, which it gives back on asking without being evicted (rule X4).
    prefix_cache_bytes: int = Field(default=0, ge=0)
    status: InstanceStatus = "ready"
    in_flight: int = Field(default=0, ge=0)
    last_used: float
    loaded_at: float
    # Measured wall seconds of the load (the model server's start included); None until it finished.
    load_seconds: float | None = Field(default=None, ge=0)
    # Seconds of prefill its kept prompt prefixes would cost again were it evicted (its engine's
    # measured prefill rate), as its last memory report said: part of what losing it costs (E3).
    prefix_reload_s: float = Field(default=0.0, ge=0)


class NodeState(Frozen):
    """One machine. Memory is one pool (unified memory on a Mac; the accelerator's memory on CUDA)."""

    node_id: str = Field(min_length=1)
    labels: dict[str, str] = Field(default_factory=dict)
    # The devices MLX can run on here; the first is where a model goes unless its spec names one.
    devices: tuple[DeviceKind, ...] = Field(default=("cpu",), min_length=1)
    total_bytes: int = Field(ge=0)
    # What we may use at most: a Mac's recommended working set, or a budget the node declares.
    usable_bytes: int = Field(ge=0)
    # In use by things that are not Orchard instances (the OS, other apps), as reported.
    foreign_bytes: int = Field(default=0, ge=0)
    # Free memory as the node agent last measured it; None if it has not reported one.
    reported_headroom_bytes: int | None = None
    instances: tuple[InstanceState, ...] = ()
    alive: bool = True
    draining: bool = False
    # Models whose weights this node's model store holds (rule L1): loading them here needs no fetch.
    stored: frozenset[str] = frozenset()
    # A spare model-server process ready on the node (rule R1): its memory, ours, which the next
    # placement here takes as its own process (its overhead) instead of starting one.
    spare_bytes: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _one_instance_per_model(self) -> "NodeState":
        if self.usable_bytes > self.total_bytes:
            raise ValueError(f"node {self.node_id}: usable_bytes exceeds total_bytes")
        names = [i.model for i in self.instances]
        if len(names) != len(set(names)):
            raise ValueError(f"node {self.node_id} holds the same model twice: {sorted(names)}")
        for inst in self.instances:
            if inst.device not in self.devices:
                raise ValueError(f"node {self.node_id} has no device {inst.device} for {inst.model}")
        return self

    def instance(self, model: str) -> InstanceState | None:
        return next((i for i in self.instances if i.model == model), None)


class FailedLoad(Frozen):
    """A model whose last load(s) failed and were not retried (rules P9, P10): requests for it are
    refused at once until `at + failed_load_backoff(failures)`; the controller clears the mark when
    a load succeeds, its files change or an operator loads it."""

    model: str
    node_id: str
    reason: LoadFailureReason
    message: str = ""
    # When the last failure was recorded (the caller's clock, like every `now`).
    at: float
    # Consecutive failures: each doubles the back-off, up to failed_load_backoff_max_s.
    failures: int = Field(default=1, ge=1)


class ClusterState(Frozen):
    """Every node plus the registry (catalog) of every model the cluster may serve or still holds."""

    nodes: tuple[NodeState, ...] = ()
    catalog: dict[str, ModelSpec] = Field(default_factory=dict)
    # Models marked failed (P10), by name.
    failed: dict[str, FailedLoad] = Field(default_factory=dict)
    # Fetch bandwidths learned from finished transfers (rule L3), bytes per second by source; a
    # source not here uses the config's figure.
    bandwidth_bytes_per_s: dict[FetchSource, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> "ClusterState":
        ids = [n.node_id for n in self.nodes]
        if len(ids) != len(set(ids)):
            raise ValueError(f"duplicate node ids: {sorted(ids)}")
        for name, spec in self.catalog.items():
            if name != spec.name:
                raise ValueError(f"catalog key {name!r} names model {spec.name!r}")
        for node in self.nodes:
            for inst in node.instances:
                if inst.model not in self.catalog:
                    raise ValueError(f"node {node.node_id} holds {inst.model!r}, which the catalog lacks")
        for name, mark in self.failed.items():
            if name != mark.model:
                raise ValueError(f"failed key {name!r} names model {mark.model!r}")
        return self

    def node(self, node_id: str) -> NodeState | None:
        return next((n for n in self.nodes if n.node_id == node_id), None)
