"""Small constructors for policy tests: sizes in GiB, sensible defaults."""

from policy import ClusterState, FailedLoad, InstanceState, ModelSpec, NodeState, PolicyConfig
from policy.config import GIB


def spec(name: str, kind: str = "llm", gb: float = 1.0, **kw) -> ModelSpec:
    kw.setdefault("reserve_context_tokens", 0)
    kw.setdefault("overhead_bytes", 0)
    return ModelSpec(name=name, kind=kind, weight_bytes=int(gb * GIB), **kw)


def inst(model: str, gb: float, *, device: str = "metal", last_used: float = 0.0, loaded_at: float = 0.0, **kw) -> InstanceState:
    return InstanceState(model=model, device=device, bytes=int(gb * GIB), last_used=last_used, loaded_at=loaded_at, **kw)


def node(node_id: str, usable_gb: float, *instances: InstanceState, devices=("metal", "cpu"), **kw) -> NodeState:
    return NodeState(
        node_id=node_id,
        devices=devices,
        total_bytes=int(usable_gb * GIB) + kw.pop("extra_total", 0),
        usable_bytes=int(usable_gb * GIB),
        instances=tuple(instances),
        **kw,
    )


def cluster(nodes, specs, failed=()) -> ClusterState:
    return ClusterState(nodes=tuple(nodes), catalog={s.name: s for s in specs}, failed={f.model: f for f in failed})


def failed(model: str, at: float, *, node_id: str = "n1", reason: str = "bad_files", failures: int = 1, message: str = "") -> FailedLoad:
    """A failed-load mark (rule P10)."""
    return FailedLoad(model=model, node_id=node_id, reason=reason, message=message, at=at, failures=failures)


# Margins off and no anti-thrash age unless a test asks: the numbers in tests stay readable.
PLAIN = PolicyConfig(safety_margin_bytes=0, safety_margin_fraction=0.0, instance_overhead_bytes=0, min_residency_s=0.0, residency_per_reload=0.0)
