"""Count caps. Each cap a placement would break becomes an excess: which instances count toward it
and how many of them must go first. Instances on dead nodes count toward nothing."""

from dataclasses import dataclass

from policy.cluster_state import ClusterState, InstanceRef, NodeState
from policy.config import PolicyConfig
from policy.specs import DeviceKind, ModelSpec


@dataclass(frozen=True)
class CapExcess:
    label: str
    members: frozenset[InstanceRef]
    excess: int
    cluster_wide: bool = False


def _excess(label: str, cap: int | None, members: list[InstanceRef]) -> CapExcess | None:
    if cap is None or len(members) + 1 <= cap:
        return None
    return CapExcess(label=label, members=frozenset(members), excess=len(members) + 1 - cap)


def global_cap_excesses(spec: ModelSpec, state: ClusterState, config: PolicyConfig) -> list[CapExcess]:
    """Caps over the whole cluster: evicting a member anywhere relieves them."""
    everything: list[InstanceRef] = []
    same_kind: list[InstanceRef] = []
    for node in state.nodes:
        if not node.alive:
            continue
        for inst in node.instances:
            ref = InstanceRef(node_id=node.node_id, model=inst.model)
            everything.append(ref)
            if state.catalog[inst.model].kind == spec.kind:
                same_kind.append(ref)
    found = [
        _excess(f"max_instances={config.max_instances}", config.max_instances, everything),
        _excess(
            f"max_per_kind[{spec.kind}]={config.max_per_kind.get(spec.kind)}",
            config.max_per_kind.get(spec.kind),
            same_kind,
        ),
    ]
    return [CapExcess(e.label, e.members, e.excess, cluster_wide=True) for e in found if e is not None]


def node_cap(node_id: str, config: PolicyConfig) -> int | None:
    return config.node_max_instances.get(node_id, config.max_instances_per_node)


def node_cap_excesses(spec: ModelSpec, node: NodeState, device: DeviceKind, state: ClusterState, config: PolicyConfig) -> list[CapExcess]:
    """Caps of one node: only evictions on that node relieve them."""
    refs = [InstanceRef(node_id=node.node_id, model=i.model) for i in node.instances]
    kinds = [state.catalog[i.model].kind for i in node.instances]
    devices = [i.device for i in node.instances]
    where = f"on {node.node_id}"
    per_device = config.max_per_device_per_node
    found = [
        _excess(f"instances per node={node_cap(node.node_id, config)} {where}", node_cap(node.node_id, config), refs),
        _excess(f"max_per_device_per_node[total]={per_device.get('total')} {where}", per_device.get("total"), refs),
        _excess(
            f"max_per_device_per_node[{device}]={per_device.get(device)} {where}",
            per_device.get(device),
            [r for r, d in zip(refs, devices, strict=True) if d == device],
        ),
        _excess(
            f"max_per_kind_per_node[{spec.kind}]={config.max_per_kind_per_node.get(spec.kind)} {where}",
            config.max_per_kind_per_node.get(spec.kind),
            [r for r, k in zip(refs, kinds, strict=True) if k == spec.kind],
        ),
    ]
    return [e for e in found if e is not None]
