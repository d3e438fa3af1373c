"""What the console page shows, as typed data: composed from the residency service's cluster view and
model list (plain data as they cross Ray), the registry's facts about each model, and the
controller's clock when this process can read it. Pure: data in, a `ConsoleView` out, so the page's
numbers and words are tested without a cluster.

A node's memory bar is its usable memory split into each instance's weights (with its overhead),
reserved KV cache and kept prompt prefixes (its prefix cache, rule X4), other processes' memory
(`foreign`), the safety margin the policy keeps free and what is left; the instance list says, for each instance, what keeps it from being evicted now."""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from policy import ModelSpec, PolicyConfig, required_bytes
from policy.specs import DeviceKind, ModelKind, Role
from router.console.wording import duration, size


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class ModelFacts(_Out):
    """What the registry says of a model that does not change while the app runs (pins do: they are
    read live from the model list): its kind and role, its memory split, keep-warm, idle timeout,
    copies and device."""

    kind: ModelKind
    role: Role = "primary"
    weight_bytes: int = 0
    kv_reserved_bytes: int = 0
    overhead_bytes: int = 0
    keep_warm: bool = False
    idle_ttl_s: float | None = None
    min_copies: int = 0
    max_copies: int = 1
    device: DeviceKind | None = None

    @property
    def need_bytes(self) -> int:
        return self.weight_bytes + self.kv_reserved_bytes + self.overhead_bytes


def facts_of(spec: ModelSpec, config: PolicyConfig) -> ModelFacts:
    """A registry model's facts, its overhead resolved as the policy resolves it."""
    return ModelFacts(
        kind=spec.kind,
        role=spec.role,
        weight_bytes=spec.weight_bytes,
        kv_reserved_bytes=spec.kv_reserved_bytes,
        overhead_bytes=required_bytes(spec, config) - spec.weight_bytes - spec.kv_reserved_bytes,
        keep_warm=spec.keep_warm,
        idle_ttl_s=spec.idle_ttl_s,
        min_copies=spec.min_copies,
        max_copies=spec.max_copies,
        device=spec.device,
    )


class ConsoleSettings(_Out):
    """What the app builder tells every ingress about the console: the registry's facts and where the
    Ray dashboard is (None: where the dashboard records it serves)."""

    models: dict[str, ModelFacts] = Field(default_factory=dict)
    dashboard_url: str | None = None


SegmentKind = Literal["weights", "kv", "cache", "spare", "foreign", "margin", "free", "over"]


class Segment(_Out):
    kind: SegmentKind
    bytes: int = Field(ge=0)
    model: str | None = None
    label: str


class CopyView(_Out):
    """A copy of a model's weights into a node's store, in progress."""

    model: str
    node_id: str
    done_bytes: int = 0
    total_bytes: int = 0
    source: str | None = None
    bytes_per_s: float | None = None
    eta_s: float | None = None
    words: str


class StoreView(_Out):
    used_bytes: int = 0
    budget_bytes: int | None = None
    free_bytes: int = 0
    models: list[str] = Field(default_factory=list)  # the registry models whose weights it holds
    copies: list[CopyView] = Field(default_factory=list)
    words: str


class NodeView(_Out):
    node_id: str
    alive: bool
    draining: bool
    devices: list[str]
    chip: str  # the node's first device and, when its labels say, the machine
    total_bytes: int
    usable_bytes: int
    foreign_bytes: int
    ours_bytes: int
    margin_bytes: int
    free_bytes: int  # usable - foreign - ours (the accounting; the policy takes the lower of this and headroom)
    headroom_bytes: int | None  # as the node last reported
    segments: list[Segment]
    words: str
    store: StoreView | None = None
    ingress_url: str | None = None


Protection = Literal["pinned", "keep_warm", "min_residency", "busy", "loading", "draining", "min_copies"]


class Guard(_Out):
    """One reason an instance stays (or, for keep-warm, goes last)."""

    protection: Protection
    words: str


class InstanceView(_Out):
    model: str
    node_id: str
    kind: str
    role: str
    status: str
    device: str
    bytes: int
    kv_bytes: int
    cache_bytes: int = 0  # its kept prompt prefixes, beside `bytes` (X4)
    in_flight: int
    leases: int
    idle_s: float | None
    loaded_s: float | None
    load_seconds: float | None
    guards: list[Guard]
    stays: str  # why it stays, in words
    actor: str | None
    actor_url: str | None = None
    memory_words: str | None = None  # its folder's estimate beside what its engine measured (M1)


class CapView(_Out):
    name: str  # the PolicyConfig field
    scope: str  # "cluster", a node id, a kind or "node/kind"
    limit: int
    used: int
    words: str


class ModelRow(_Out):
    id: str
    kind: str
    role: str
    status: str
    nodes: list[str]
    stored_on: list[str]
    pinned: bool
    keep_warm: bool
    need_bytes: int | None
    words: str


class PolicyView(_Out):
    caps: list[CapView]
    utility: list[str]
    pinned: list[str]
    keep_warm: list[str]
    eviction: str
    sentences: list[str]


class ConsoleView(_Out):
    nodes: list[NodeView]
    instances: list[InstanceView]
    models: list[ModelRow]
    policy: PolicyView
    dashboard_url: str | None
    # The residency controller's clock (the events' `at` and the instances' times are on it), None when
    # this ingress's node cannot read it: idle times and minimum residency are then left out.
    now: float | None


_EVICTION_WORDS = {
    "cost": (
        "cost: evict what is cheapest to lose. Each instance is worth its reload time (utility models count {w}x) divided by how "
        "long it has been idle (plus {floor} s): a large model idle for long goes before small helpers in use"
    ),
    "lru": "lru: the same kind first, then the least recently used (Lemonade's and Ray Serve's way)",
    "fewest": "fewest: the fewest instances that make room",
}


def _facts(settings: ConsoleSettings, model: str, listed: dict[str, dict[str, Any]]) -> ModelFacts:
    found = settings.models.get(model)
    if found is not None:
        return found
    return ModelFacts(kind=listed.get(model, {}).get("kind", "llm"))


def _segments(node: dict[str, Any], facts: dict[str, ModelFacts], margin: int) -> list[Segment]:
    mem = node["memory"]
    out = []
    for inst in node["instances"]:
        f = facts.get(inst["model"])
        kv = min(f.kv_reserved_bytes, inst["bytes"]) if f else 0
        loading = " (loading)" if inst["status"] == "loading" else ""
        out.append(
            Segment(kind="weights", bytes=inst["bytes"] - kv, model=inst["model"], label=f"{inst['model']}{loading}: {size(inst['bytes'] - kv)}")
        )
        if kv:
            out.append(Segment(kind="kv", bytes=kv, model=inst["model"], label=f"{inst['model']} KV reserved: {size(kv)}"))
        cache = inst.get("prefix_cache_bytes") or 0  # the instance's own, given back before an eviction (X4)
        if cache:
            out.append(Segment(kind="cache", bytes=cache, model=inst["model"], label=f"{inst['model']} kept prompt prefixes: {size(cache)}"))
    spare = (node.get("spare") or {}).get("bytes") or 0  # R1: the next placement's process, started ahead
    if spare:
        out.append(Segment(kind="spare", bytes=spare, label=f"spare process (the next load here starts in it): {size(spare)}"))
    foreign = mem["foreign_bytes"]
    if foreign:
        out.append(Segment(kind="foreign", bytes=foreign, label=f"other processes: {size(foreign)}"))
    left = mem["usable_bytes"] - foreign - mem["ours_bytes"]
    if left < 0:
        out.append(Segment(kind="over", bytes=-left, label=f"over usable by {size(-left)}"))
        return out
    kept = min(margin, left)
    if left - kept:
        out.append(Segment(kind="free", bytes=left - kept, label=f"room for models: {size(left - kept)}"))
    if kept:
        out.append(Segment(kind="margin", bytes=kept, label=f"safety margin kept free: {size(kept)}"))
    return out


def _node(
    node: dict[str, Any], facts: dict[str, ModelFacts], config: PolicyConfig, copies: list[CopyView], ingress: dict[str, str], listed
) -> NodeView:
    mem = node["memory"]
    margin = config.safety_margin_bytes + int(config.safety_margin_fraction * mem["usable_bytes"])
    free = mem["usable_bytes"] - mem["foreign_bytes"] - mem["ours_bytes"]
    labels = node.get("labels") or {}
    chip = (node["devices"] or ["?"])[0]
    if node.get("chip") or labels.get("orchard.chip"):  # as the node's agent names it, else its label
        chip = f"{node.get('chip') or labels['orchard.chip']} ({chip})"
    if not node["alive"]:
        words = f"{node['node_id']} is dead: nothing is placed there"
    else:
        room = max(0, free - margin)
        cached = sum(i.get("prefix_cache_bytes") or 0 for i in node["instances"])
        kept = f" ({size(cached)} of it kept prompt prefixes, given back before any eviction)" if cached else ""
        spare = (node.get("spare") or {}).get("bytes") or 0
        spared = f" and a spare process ({size(spare)}: the next load here runs in it)" if spare else ""
        words = (
            f"{node['node_id']}: {size(mem['ours_bytes'])} held by {len(node['instances'])} instance(s){kept}{spared}, "
            f"{size(mem['foreign_bytes'])} by other processes, "
            f"{size(room)} of room for another model (after the {size(margin)} margin) out of {size(mem['usable_bytes'])} usable"
        )
        if mem.get("headroom_bytes") is not None:
            words += f"; the node last reported {size(mem['headroom_bytes'])} free"
        if node["draining"]:
            words += "; draining: nothing new is placed there"
    store = None
    raw = node.get("store")
    if raw:
        mine = [c for c in copies if c.node_id == node["node_id"]]
        held = sorted(m for m, row in listed.items() if node["node_id"] in row.get("stored_on", ()))
        budget = raw.get("budget_bytes")
        said = (
            f"store: {size(raw.get('used_bytes', 0))} used"
            + (f" of a {size(budget)} budget" if budget else "")
            + f", {size(raw.get('free_bytes', 0))} free on disk"
        )
        if mine:
            said += f"; {len(mine)} copy(ies) coming in"
        if raw.get("prefix_bytes"):  # the prefix cache's disk tier beside it, its own budget
            said += f"; kept prompt prefixes on disk: {size(raw['prefix_bytes'])}"
        store = StoreView(
            used_bytes=raw.get("used_bytes", 0), budget_bytes=budget, free_bytes=raw.get("free_bytes", 0), models=held, copies=mine, words=said
        )
    return NodeView(
        node_id=node["node_id"],
        alive=node["alive"],
        draining=node["draining"],
        devices=list(node["devices"]),
        chip=chip,
        total_bytes=mem["total_bytes"],
        usable_bytes=mem["usable_bytes"],
        foreign_bytes=mem["foreign_bytes"],
        ours_bytes=mem["ours_bytes"],
        margin_bytes=margin,
        free_bytes=free,
        headroom_bytes=mem.get("headroom_bytes"),
        segments=_segments(node, facts, margin),
        words=words,
        store=store,
        ingress_url=ingress.get(node["node_id"]),
    )


def _guards(inst: dict[str, Any], f: ModelFacts, row: dict[str, Any], config: PolicyConfig, now: float | None, ready_copies: int) -> list[Guard]:
    out = []
    if row.get("pinned"):
        out.append(Guard(protection="pinned", words="pinned: never evicted, never unloaded when idle (E1)"))
    if inst["status"] == "loading":
        out.append(Guard(protection="loading", words="loading: not evicted while it loads (E2)"))
    if inst["status"] == "draining":
        out.append(Guard(protection="draining", words="draining: it leaves once its requests end (W1)"))
    busy = max(inst.get("in_flight", 0), inst.get("leases", 0))
    if busy:
        out.append(Guard(protection="busy", words=f"busy: {busy} request(s) or lease(s) in flight; never evicted while busy (E2)"))
    protected_s = inst.get("protected_for_s", config.min_residency_s)
    if now is not None and inst["status"] == "ready" and protected_s > 0:
        left = inst["loaded_at"] + protected_s - now
        if left > 0:
            out.append(
                Guard(
                    protection="min_residency",
                    words=f"young: loaded {duration(now - inst['loaded_at'])} ago, protected for {duration(protected_s)} "
                    f"(twice what reloading it would cost), evictable in {duration(left)} (E3)",
                )
            )
    if f.min_copies and ready_copies <= f.min_copies:
        out.append(Guard(protection="min_copies", words=f"min_copies {f.min_copies}: the model keeps this many ready copies (E4)"))
    if f.keep_warm:
        out.append(
            Guard(protection="keep_warm", words="keep-warm: evicted last, only when nothing else makes room, and never unloaded when idle (E5)")
        )
    return out


def _memory_words(memory: dict[str, Any] | None) -> str | None:
    """An instance's measured memory beside its folder's estimate (/v1/cluster's `memory`, M1)."""
    if not memory:
        return None
    est, got = memory["estimated"], memory["measured"]
    return (
        f"measured: weights {size(got['weight_bytes'])} + KV {size(got['kv_reserved_bytes'])} + a step's activations "
        f"{size(got['activation_bytes'])} (MLX limit {size(got['limit_bytes'])}); "
        f"estimated: weights {size(est['weight_bytes'])} + KV {size(est['kv_reserved_bytes'])}"
    )


def _stays(guards: list[Guard], inst: dict[str, Any], f: ModelFacts, config: PolicyConfig, now: float | None) -> str:
    hard = [g for g in guards if g.protection != "keep_warm"]
    if hard:
        return "protected now: " + "; ".join(g.words for g in hard)
    ttl = f.idle_ttl_s if f.idle_ttl_s is not None else config.default_idle_ttl_s
    if f.keep_warm:
        idle = "kept warm"
    elif ttl is None:
        idle = "no idle timeout"
    elif now is not None:
        idle = f"unloaded when idle for {duration(ttl)} ({duration(max(0.0, inst['last_used'] + ttl - now))} from now if unused)"
    else:
        idle = f"unloaded after {duration(ttl)} idle"
    return (
        f"evictable: it stays until another model needs its room ({'goes last' if f.keep_warm else 'by the ' + config.eviction + ' order'}); {idle}"
    )


def _caps(config: PolicyConfig, nodes: list[dict[str, Any]], facts: dict[str, ModelFacts], listed) -> list[CapView]:
    alive = [n for n in nodes if n["alive"]]

    def kind_of(model: str) -> str:
        f = facts.get(model)
        return f.kind if f else listed.get(model, {}).get("kind", "?")

    every = [(n["node_id"], i) for n in alive for i in n["instances"]]
    out = []
    if config.max_instances is not None:
        out.append(
            CapView(
                name="max_instances",
                scope="cluster",
                limit=config.max_instances,
                used=len(every),
                words=f"at most {config.max_instances} instances in the cluster",
            )
        )
    for n in alive:
        limit = config.node_max_instances.get(n["node_id"], config.max_instances_per_node)
        if limit is not None:
            out.append(
                CapView(
                    name="max_instances_per_node",
                    scope=n["node_id"],
                    limit=limit,
                    used=len(n["instances"]),
                    words=f"at most {limit} instances on {n['node_id']}",
                )
            )
    for kind, limit in sorted(config.max_per_kind.items()):
        used = sum(1 for _, i in every if kind_of(i["model"]) == kind)
        out.append(CapView(name="max_per_kind", scope=kind, limit=limit, used=used, words=f"at most {limit} {kind} instance(s) in the cluster"))
    for n in alive:
        for kind, limit in sorted(config.max_per_kind_per_node.items()):
            used = sum(1 for i in n["instances"] if kind_of(i["model"]) == kind)
            out.append(
                CapView(
                    name="max_per_kind_per_node",
                    scope=f"{n['node_id']}/{kind}",
                    limit=limit,
                    used=used,
                    words=f"at most {limit} {kind} on {n['node_id']}",
                )
            )
        for device, limit in sorted(config.max_per_device_per_node.items()):
            used = len(n["instances"]) if device == "total" else sum(1 for i in n["instances"] if i["device"] == device)
            what = "instances in all" if device == "total" else f"on {device}"
            out.append(
                CapView(
                    name="max_per_device_per_node",
                    scope=f"{n['node_id']}/{device}",
                    limit=limit,
                    used=used,
                    words=f"at most {limit} {what} on {n['node_id']}",
                )
            )
    return out


def _young_words(config: PolicyConfig) -> str:
    """E3 in words: how long a freshly loaded instance is protected (anti-thrash)."""
    parts = []
    if config.residency_per_reload:
        parts.append(
            f"for {config.residency_per_reload:g}x what reloading it would cost (its measured load and the prefill of its kept prompts), "
            f"at most {duration(config.max_residency_s)}"
        )
    if config.min_residency_s:
        parts.append(f"at least {duration(config.min_residency_s)}")
    if not parts:
        return "Young instances may be evicted at once (residency_per_reload and min_residency_s 0)."
    return "A freshly loaded instance is not evicted " + ", ".join(parts) + " (anti-thrash, E3)."


def _policy(config: PolicyConfig, nodes, facts: dict[str, ModelFacts], listed: dict[str, dict[str, Any]]) -> PolicyView:
    names = sorted(listed)
    eviction = _EVICTION_WORDS[config.eviction].format(w=config.cost.utility_weight, floor=config.cost.idle_floor_s)
    sentences = [
        f"Eviction preference: {eviction}. Whatever the order, pinned, busy, loading and young instances are never evicted, keep-warm ones go last, "
        "and no more are evicted than the room needs (E1-E7).",
        "Where a model fits without evicting, it goes where it is ready soonest (its weights already on disk there first), then "
        + ("the tightest fit (pack: large holes stay for large models)." if config.fit_preference == "pack" else "the emptiest node (spread)."),
        f"Every node keeps {size(config.safety_margin_bytes)}"
        + (f" + {config.safety_margin_fraction:.0%} of its usable memory" if config.safety_margin_fraction else "")
        + f" free after any placement; an instance's need is its weights + reserved KV + {size(config.instance_overhead_bytes)} overhead unless its spec says.",
        _young_words(config),
        (
            f"When only busy instances stand in the way, a request waits up to {duration(config.wait_timeout_s)}, then fails with the reason."
            if config.contention == "wait"
            else "When only busy instances stand in the way, a request fails at once with the reason and a Retry-After."
        ),
        f"Idle instances are unloaded after {duration(config.default_idle_ttl_s)} unless their model says otherwise; pinned and keep-warm ones never."
        if config.default_idle_ttl_s
        else "Idle instances stay until their room is needed, unless their model has an idle timeout; pinned and keep-warm ones always stay.",
        f"Background copies of weights: {config.background_copies}.",
    ]
    return PolicyView(
        caps=_caps(config, nodes, facts, listed),
        utility=[m for m in names if (facts.get(m) and facts[m].role == "utility")],
        pinned=[m for m in names if listed[m].get("pinned")],
        keep_warm=[m for m in names if listed[m].get("keep_warm")],
        eviction=config.eviction,
        sentences=sentences,
    )


def _copies(listed: dict[str, dict[str, Any]]) -> list[CopyView]:
    out = []
    for model, row in sorted(listed.items()):
        for node_id, p in sorted((row.get("fetching") or {}).items()):
            done, total = p.get("done_bytes", 0), p.get("total_bytes", 0)
            rate, eta = p.get("bytes_per_s"), p.get("eta_s")
            words = f"{model} to {node_id}: {size(done)} of {size(total)}"
            if rate:
                words += f" at {rate / 1e6:.1f} MB/s"
            if eta is not None:
                words += f", about {duration(eta)} left"
            src = p.get("source")
            out.append(
                CopyView(
                    model=model,
                    node_id=node_id,
                    done_bytes=done,
                    total_bytes=total,
                    source=str(src) if src is not None else None,
                    bytes_per_s=rate,
                    eta_s=eta,
                    words=words,
                )
            )
    return out


def compose(
    cluster: dict[str, Any],
    models: list[dict[str, Any]],
    settings: ConsoleSettings,
    *,
    now: float | None,
    dashboard_url: str | None = None,
    actor_ids: dict[str, str] | None = None,
) -> ConsoleView:
    """The console's view of `cluster` (ResidencyService.cluster) and `models` (ResidencyService.models).
    `now`: the residency controller's clock (`cluster["now"]`; None: idle times and minimum residency
    are left out); `actor_ids`: actor name -> Ray actor id, for the dashboard's links."""
    config = PolicyConfig.model_validate(cluster.get("policy") or {})
    listed = {m["id"]: m for m in models}
    facts = {name: _facts(settings, name, listed) for name in set(listed) | {i["model"] for n in cluster["nodes"] for i in n["instances"]}}
    ingress = {e["node_id"]: e["url"] for e in cluster.get("ingress") or ()}
    copies = _copies(listed)
    nodes = [_node(n, facts, config, copies, ingress, listed) for n in cluster["nodes"]]
    ready = {
        name: sum(1 for n in cluster["nodes"] if n["alive"] for i in n["instances"] if i["model"] == name and i["status"] == "ready")
        for name in facts
    }
    instances = []
    for n in cluster["nodes"]:
        for inst in n["instances"] if n["alive"] else ():
            f, row = facts[inst["model"]], listed.get(inst["model"], {})
            guards = _guards(inst, f, row, config, now, ready.get(inst["model"], 0))
            actor = inst.get("actor")
            actor_id = (actor_ids or {}).get(actor or "")
            instances.append(
                InstanceView(
                    model=inst["model"],
                    node_id=n["node_id"],
                    kind=f.kind,
                    role=f.role,
                    status=inst["status"],
                    device=inst["device"],
                    bytes=inst["bytes"],
                    kv_bytes=min(f.kv_reserved_bytes, inst["bytes"]),
                    cache_bytes=inst.get("prefix_cache_bytes") or 0,
                    in_flight=inst.get("in_flight", 0),
                    leases=inst.get("leases", 0),
                    idle_s=max(0.0, now - inst["last_used"]) if now is not None else None,
                    loaded_s=max(0.0, now - inst["loaded_at"]) if now is not None else None,
                    load_seconds=inst.get("load_seconds"),
                    guards=guards,
                    stays=_stays(guards, inst, f, config, now),
                    actor=actor,
                    actor_url=f"{dashboard_url}/#/actors/{actor_id}" if dashboard_url and actor_id else None,
                    memory_words=_memory_words(inst.get("memory")),
                )
            )
    rows = []
    for name, row in sorted(listed.items()):
        f = facts[name]
        status = row.get("status", "?")
        where = f" on {', '.join(row['nodes'])}" if row.get("nodes") else ""
        words = f"{status}{where}"
        if row.get("failure"):
            fail = row["failure"]
            words += f": failed on {fail['node_id']} ({fail['reason']}: {fail['message']}), tried again in {duration(fail['retry_in_s'])}"
        rows.append(
            ModelRow(
                id=name,
                kind=f.kind,
                role=f.role,
                status=status,
                nodes=list(row.get("nodes") or ()),
                stored_on=list(row.get("stored_on") or ()),
                pinned=bool(row.get("pinned")),
                keep_warm=bool(row.get("keep_warm")),
                need_bytes=f.need_bytes if name in settings.models else None,
                words=words,
            )
        )
    return ConsoleView(
        nodes=nodes,
        instances=instances,
        models=rows,
        policy=_policy(config, cluster["nodes"], facts, listed),
        dashboard_url=dashboard_url,
        now=now,
    )
