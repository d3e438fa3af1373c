"""The residency log's lines (GET /v1/cluster/events, the metrics, the operator's store): what the
residency service writes and every other process reads."""

from typing import Literal

from policy._frozen import Frozen

EventKind = Literal[
    "placed",
    "loaded",
    "load_failed",
    "retrying",
    "evicted",
    "draining",
    "released",
    "stopped",
    "loading",
    "unloaded",
    "died",
    "rejected",
    "waiting",
    "gave_up",
    "node_up",
    "node_dead",
    "node_suspect",
    "pinned",
    "unpinned",
    "lease_expired",
    "fetching",
    "fetched",
    "fetch_failed",
    "files_removed",
    "cancelled",
    "caches_shrunk",
]


class ClusterEvent(Frozen):
    """One line of the placement / eviction / rejection log (GET /v1/cluster/events)."""

    seq: int
    at: float
    kind: EventKind
    model: str | None = None
    node_id: str | None = None
    reason: str = ""
    bytes: int | None = None
    seconds: float | None = None
    # Why, as one word a metric can use as a label (the reason says it in words): an unload's
    # idle / operator / node_dead / node_suspect / draining, an eviction's placement / retry / swap,
    # a copy's peer / hub.
    cause: str | None = None
