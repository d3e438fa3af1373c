"""Count caps. Each cap a placement would break becomes an excess: which instances count toward it
and how many of them must go first. Instances on dead nodes count toward nothing."""

from dataclasses import dataclass

from policy.cluster_state import ClusterState, NodeState, RefKey
from policy.config import PolicyConfig
from policy.specs import DeviceKind, ModelSpec


@dataclass(frozen=True)
class CapExcess:
    label: str
    members: frozenset[RefKey]
    excess: int
    cluster_wide: bool = False


def _excess(label: str, cap: int | None, members: list[RefKey], cluster_wide: bool = False) -> CapExcess | None:
    if cap is None or len(members) + 1 <= cap:
        return None
    return CapExcess(label=label, members=frozenset(members), excess=len(members) + 1 - cap, cluster_wide=cluster_wide)


def global_cap_excesses(spec: ModelSpec, state: ClusterState, config: PolicyConfig) -> list[CapExcess]:
    """Caps over the whole cluster: evicting a member anywhere relieves them. Instances are listed
    only for a cap that is set (most are not, and listing them walks every instance)."""
    kind_cap = config.max_per_kind.get(spec.kind)
    if config.max_instances is None and kind_cap is None:
        return []
    everything: list[RefKey] = []
    same_kind: list[RefKey] = []
    for node in state.nodes:
        if node.alive:
            node_id = node.node_id
            for inst in node.instances:
                everything.append((node_id, inst.model))
                if kind_cap is not None and state.catalog[inst.model].kind == spec.kind:
                    same_kind.append((node_id, inst.model))
    found = [
        _excess(f"max_instances={config.max_instances}", config.max_instances, everything, cluster_wide=True),
        _excess(f"max_per_kind[{spec.kind}]={kind_cap}", kind_cap, same_kind, cluster_wide=True),
    ]
    return [e for e in found if e is not None]


def node_cap(node_id: str, config: PolicyConfig) -> int | None:
    return config.node_max_instances.get(node_id, config.max_instances_per_node)


def node_caps_set(spec: ModelSpec, config: PolicyConfig) -> bool:
    """Whether any per-node cap could count this model; when none does, node_cap_excesses is empty
    on every node."""
    return (
        config.max_instances_per_node is not None
        or bool(config.node_max_instances)
        or bool(config.max_per_device_per_node)
        or config.max_per_kind_per_node.get(spec.kind) is not None
    )


def node_cap_excesses(spec: ModelSpec, node: NodeState, device: DeviceKind, state: ClusterState, config: PolicyConfig) -> list[CapExcess]:
    """Caps of one node: only evictions on that node relieve them."""
    refs = [(node.node_id, i.model) for i in node.instances]
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
