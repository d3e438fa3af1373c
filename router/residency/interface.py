"""What the residency loop asks of its effects: the orders (everything a command needs, decided by
the loop from its state) and the `Effects` protocol the Ray effects (effects.py) and the loop's
test rig (tests/support/loop.py) implement. A command keeps no state of the cluster; it answers
with what happened (a result, or LoadError / NodeUnreachable), which the loop applies as an event."""

from typing import Protocol

from cluster.node_report import FetchResult, StoreReport
from deployments.manifest import ManifestEntry
from deployments.wire.events import ClusterEvent
from deployments.wire.measured import MeasuredMemory
from deployments.wire.reports import Released
from policy import InstanceRef, ModelSpec, Place
from policy._frozen import Frozen
from router.residency.events import LoadResult


class StartOrder(Frozen):
    """Start a model server for `place` as actor `actor` on the Ray node `ray_node_id`, loading the
    weights from the folder `folder` of the store at `root` (None: the registry's own path)."""

    place: Place
    spec: ModelSpec
    entry: ManifestEntry | None  # None: not in the registry's entries (the loop's tests)
    actor: str
    ray_node_id: str | None
    root: str | None = None
    spare: bool = False  # `actor` is a spare that takes the model (R1), not a server to start
    store_root: str | None = None  # the node's model store (its agent's report): the prefix disk tier lives beside it
    measured: MeasuredMemory | None = None  # what the model's last load measured (M1): its engine measures again only for other weights or settings


class FetchOrder(Frozen):
    """Bring the model's folder into `node_id`'s store at `root`: copied from the first of `sources`
    that serves it, else (`hub`) downloaded; nothing to do when `root` is None (the node has no
    store) or the store holds it. `keep`: folders the copy may not remove for room; `background`:
    a speculative copy's reason (L4)."""

    model: str
    node_id: str
    entry: ManifestEntry | None  # None: not in the registry's entries (the loop's tests)
    root: str | None
    sources: tuple[str, ...] = ()
    hub: bool = False
    keep: tuple[str, ...] = ()
    background: str | None = None

    @property
    def needed(self) -> bool:
        return self.root is not None and self.entry is not None and self.entry.folder is not None and (bool(self.sources) or self.hub)


class Effects(Protocol):
    """Commands told everything they need in their order (the loop's Sites decides it), each
    answering with what happened; none keeps state of the cluster."""

    def new_actor_name(self, model: str, node_id: str) -> str:
        """The name of a new incarnation of the model's server on the node."""
        ...

    async def start_instance(self, order: StartOrder) -> LoadResult: ...

    def new_spare_name(self, node_id: str) -> str:
        """The name of a new spare model server on the node (R1)."""
        ...

    async def start_spare(self, node_id: str, ray_node_id: str | None, actor: str) -> int:
        """Start a spare model server (R1) named `actor` on the node; its memory once it runs."""
        ...

    async def stop_spare(self, node_id: str, actor: str, reason: str) -> None:
        """Stop the spare `actor` (it is gone when this returns, or it never started)."""
        ...

    async def release_instance(self, instance: InstanceRef, actor: str | None, reason: str) -> Released | None:
        """Drain the incarnation `actor` and stop its engine, which gives its model's memory back in
        its process (X1); what it gave back and still holds, measured there. None: no actor, or no
        answer (its exit decides)."""
        ...

    async def spare_again(self, actor: str, max_models: int) -> int | None:
        """R1: the model server `actor`, its engine stopped, becomes a spare again if it has held
        fewer than `max_models` models and its engine left nothing behind; what its process holds
        then, or None (the caller ends it)."""
        ...

    async def stop_instance(self, instance: InstanceRef, actor: str | None, reason: str) -> bool:
        """Stop the incarnation `actor`; True once no process of it runs any more."""
        ...

    def want_report(self, node_id: str) -> None:
        """Ask the node for a fresh memory report soon: it arrives as `NodeReported`."""
        ...

    async def fetch_weights(self, order: FetchOrder) -> FetchResult:
        """Put the model's weights in the node's store as the order says; how it ended comes back."""
        ...

    async def shrink_caches(self, actors: list[str]) -> int:
        """Ask these model servers to give back their kept prompt prefixes (X4); the bytes freed."""
        ...

    async def store_report(self, node_id: str) -> StoreReport | None:
        """The node's store as its agent sees it now (None: it has no store, or no agent answers)."""
        ...

    async def remove_files(self, node_id: str, folder: str) -> bool:
        """Remove a folder from the node's store; True when it was removed (OrchardError when its
        agent refuses, e.g. files in use)."""
        ...

    def publish(self, event: ClusterEvent) -> None: ...

    def files_version(self, model: str) -> str | None:
        """Something that changes when the model's files do (sizes and times), None if unknown."""
        ...
