"""The operator's residency policy: caps, safety margin, eviction strategy, contention, timeouts."""

from typing import Literal

from pydantic import ByteSize, Field, model_validator

from policy._frozen import Frozen
from policy.specs import DeviceKind, ModelKind

EvictionStrategy = Literal["lru", "cost", "fewest"]
Contention = Literal["fail", "wait"]
FitPreference = Literal["pack", "spread"]
BackgroundCopies = Literal["off", "requested", "catalog"]

GIB = 1024**3
MIB = 1024**2


class CostWeights(Frozen):
    """Knobs of the `cost` strategy's keep value (see docs/residency.md, rule E3)."""

    # Added to idle seconds so a just-used instance does not get an infinite keep value.
    idle_floor_s: float = Field(default=60.0, gt=0)
    # Utility models (embedders, rerankers, STT) are reused often by the primary model's callers.
    utility_weight: float = Field(default=2.0, gt=0)


class PolicyConfig(Frozen):
    """Every cap is optional: None or an absent key means no cap of that kind."""

    # Loaded instances in the whole cluster.
    max_instances: int | None = Field(default=None, ge=0)
    # Loaded instances on any one node, and overrides for named nodes.
    max_instances_per_node: int | None = Field(default=None, ge=0)
    node_max_instances: dict[str, int] = Field(default_factory=dict)
    # Per model kind, in the whole cluster and on any one node.
    max_per_kind: dict[ModelKind, int] = Field(default_factory=dict)
    max_per_kind_per_node: dict[ModelKind, int] = Field(default_factory=dict)
    # Per device on one node, Lemonade's {"gpu": 1, "cpu": 2, "total": 3} keyed by our device kinds.
    max_per_device_per_node: dict[DeviceKind | Literal["total"], int] = Field(default_factory=dict)

    # Headroom kept free on every node: a fixed amount plus a fraction of its usable memory.
    # Sizes take integers or strings such as "512MiB".
    safety_margin_bytes: ByteSize = ByteSize(512 * MIB)
    safety_margin_fraction: float = Field(default=0.02, ge=0, lt=1)
    # Reserved per instance on top of weights and KV when its spec does not say.
    instance_overhead_bytes: ByteSize = ByteSize(256 * MIB)

    eviction: EvictionStrategy = "cost"
    cost: CostWeights = CostWeights()
    # Where a model fits without eviction on several nodes: fill the tightest (pack, keeps large
    # holes for large models) or the emptiest (spread).
    fit_preference: FitPreference = "pack"
    # Anti-thrash (rule E3): a loaded instance is not evicted while it is younger than
    # residency_per_reload x what losing it costs (its measured reload seconds, process start
    # included, plus the prefill its kept prompt prefixes would cost again), that figure at most
    # max_residency_s, the whole at least min_residency_s. The default protects a model for twice its
    # reload, so no instance spends more than a third of its life loading; a model that comes back in
    # half a second is not held against a waiting one for 10. min_residency_s 10 with
    # residency_per_reload 0 is the fixed rule (ModelMesh's minChurnAge).
    residency_per_reload: float = Field(default=2.0, ge=0)
    min_residency_s: float = Field(default=0.0, ge=0)
    max_residency_s: float = Field(default=30.0, ge=0)

    # Spare processes (rule R1): each node keeps this many model-server processes started ahead
    # of demand (0 or 1), so a placement loads weights into a running process instead of starting
    # one; only where the node has room for one beyond the margin. Its memory, as measured once it
    # runs (spare_bytes until then), is ours and becomes the next instance's overhead there.
    spares_per_node: int = Field(default=1, ge=0, le=1)
    spare_bytes: ByteSize = ByteSize(256 * MIB)
    # A process started as a spare holds this many models in turn at most: after an eviction it
    # becomes its node's spare again where the node wants one (R1), instead of exiting. 1: every
    # process exits with its model.
    process_models_max: int = Field(default=8, ge=1)
    # ... and only while it holds at most this much more than a new spare measured on its node
    # (a process grows with the models it held; an instance's overhead estimates a new one's size).
    spare_growth_max: float = Field(default=1.5, ge=1.0)

    # When only busy, loading or young instances stand in the way: fail at once, or wait up to
    # wait_timeout_s (asking again every retry_poll_s) and then fail.
    contention: Contention = "wait"
    wait_timeout_s: float = Field(default=60.0, ge=0)
    retry_poll_s: float = Field(default=1.0, gt=0)

    # Swaps (rules W1-W3): a request that has waited swap_after_s for a model that busy instances
    # keep out has one of them drained for it (no new requests, what runs finishes, then the swap),
    # at most max_swaps_per_node_per_minute swaps started on any one node per minute (0: never drain).
    swap_after_s: float = Field(default=2.0, ge=0)
    max_swaps_per_node_per_minute: int = Field(default=6, ge=0)

    # Unload, then load (rule X1): a load placed on a node where instances are stopping (its
    # victims, unloads) starts once they have exited and a report of the node shows the room; it
    # waits at most this long, then fails (load_failed, no_room) having loaded nothing.
    exit_wait_s: float = Field(default=60.0, gt=0)

    # Idle instances are unloaded after this many seconds unless their spec says otherwise; None: never.
    default_idle_ttl_s: float | None = Field(default=None, gt=0)

    # For reload-time estimates before a load was measured: seconds = base + bytes / bandwidth.
    load_bandwidth_bytes_per_s: ByteSize = ByteSize(2 * GIB)
    load_base_s: float = Field(default=1.0, ge=0)
    # Fetch time estimates before a transfer was measured (rule L1): a copy from another node's
    # store (a Thunderbolt bridge or 10 GbE link moves about this), a download from the Hub.
    peer_bandwidth_bytes_per_s: ByteSize = ByteSize(500 * MIB)
    hub_bandwidth_bytes_per_s: ByteSize = ByteSize(50 * MIB)

    # Background copies (rule L4): while a node has no copy coming in, copy into its store the most
    # requested model it lacks ("requested"), then, with "catalog", every other one, smallest first;
    # within its disk budget and free disk less the reserve, never removing a folder for it. Off by
    # default: it spends links and disk no request asked for.
    background_copies: BackgroundCopies = "off"
    # Requests are counted per model with this half-life; a model below the minimum is not copied.
    demand_half_life_s: float = Field(default=1800.0, gt=0)
    background_copy_min_demand: float = Field(default=1.0, gt=0)
    background_copy_disk_reserve_bytes: ByteSize = ByteSize(10 * GIB)
    # ... and only while the store, with the copy, stays within this share of its disk budget: the
    # rest is left to copies a placement waits for (background copies that fill a budget are
    # removed by the next such copy, and copied again: churn the simulator measured).
    background_copy_budget_share: float = Field(default=0.5, gt=0, le=1)
    # A background copy that failed (source gone, checksum, disk full) is not tried again on that
    # node for this long; the node copies the next model meanwhile.
    background_copy_retry_s: float = Field(default=600.0, ge=0)

    # A model whose load failed and is not retried (P9) is refused at once for a back-off (P10):
    # base x 2^(consecutive failures - 1), at most the max. 0 turns the back-off off (the next
    # request tries again, still without evicting for the failure).
    failed_load_backoff_s: float = Field(default=30.0, ge=0)
    failed_load_backoff_max_s: float = Field(default=600.0, ge=0)

    @model_validator(mode="after")
    def _backoff_cap_covers_base(self) -> "PolicyConfig":
        if self.failed_load_backoff_max_s < self.failed_load_backoff_s:
            raise ValueError("failed_load_backoff_max_s is below failed_load_backoff_s")
        return self
