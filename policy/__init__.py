"""Orchard's residency policy: pure functions from cluster state to decisions.

No Ray, no MLX, no clock, no I/O: the caller passes `now` and applies the decision. The rules are
written down in docs/residency.md, each pointing at its test."""

from policy.background import BackgroundCopy, StoreRoom, plan_background_copies
from policy.cluster_state import ClusterState, FailedLoad, InstanceRef, InstanceState, LoadFailureReason, NodeState
from policy.config import CostWeights, PolicyConfig
from policy.copies import plan_copies
from policy.count_only import count_only_lru
from policy.decisions import Blocker, Blockers, Decision, LoadFailure, Place, Reject, Unload, Use, Wait
from policy.failures import failed_load_backoff
from policy.locality import fetch_seconds, fetch_source
from policy.memory import free_bytes, required_bytes
from policy.placement import ensure, retry_after_failure
from policy.spares import plan_spares
from policy.specs import DEVICE_KINDS, MODEL_KINDS, DeviceKind, ModelKind, ModelSpec, Role
from policy.sweep import sweep
from policy.transitions import clear_failed, learn_bandwidth, mark_failed, mark_stored

__all__ = [
    "BackgroundCopy",
    "Blocker",
    "Blockers",
    "ClusterState",
    "CostWeights",
    "DEVICE_KINDS",
    "Decision",
    "DeviceKind",
    "FailedLoad",
    "InstanceRef",
    "InstanceState",
    "LoadFailure",
    "LoadFailureReason",
    "MODEL_KINDS",
    "ModelKind",
    "ModelSpec",
    "NodeState",
    "Place",
    "PolicyConfig",
    "Reject",
    "Role",
    "StoreRoom",
    "Unload",
    "Use",
    "Wait",
    "clear_failed",
    "count_only_lru",
    "ensure",
    "failed_load_backoff",
    "fetch_seconds",
    "fetch_source",
    "learn_bandwidth",
    "mark_stored",
    "plan_background_copies",
    "plan_copies",
    "plan_spares",
    "free_bytes",
    "mark_failed",
    "required_bytes",
    "retry_after_failure",
    "sweep",
]
