"""Where things are on the real cluster, as the residency loop knows it: each node's Ray id and last
store report, each instance's actor (the name of its current incarnation), and the registry's
entries (which folder a model's weights live in). The loop owns it and changes it only in its own
steps (a node's report, a start, a stop, an adoption, files removed); the effects get what they
need from it in an order (`StartOrder`, `FetchOrder`: interface.py) and keep nothing."""

from cluster.node_report import StoreReport
from deployments.manifest import ManifestEntry
from deployments.wire.measured import MeasuredMemory
from policy import InstanceRef, ModelSpec, Place, StoreRoom
from router.residency.interface import FetchOrder, StartOrder


class Sites:
    def __init__(self, entries: dict[str, ManifestEntry]):
        self.entries = entries
        self.ray_ids: dict[str, str] = {}  # Orchard node id -> Ray node id
        self.chips: dict[str, str] = {}  # Orchard node id -> its chip, as its agent names it
        self.stores: dict[str, StoreReport] = {}  # Orchard node id -> its store's last report
        self.actors: dict[tuple[str, str], str] = {}  # (model, node) -> actor name of its current incarnation
        self._added: dict[str, dict[str, tuple[float, int]]] = {}  # node -> folder copied in -> (when, bytes)

    # ---- what the loop learns ---------------------------------------------------------------------
    def reported(self, node_id: str, ray_node_id: str | None, store: StoreReport | None, asked_at: float, chip: str | None = None) -> None:
        """A node's report, asked for at `asked_at`: the folders copied in after that stay as `added` said."""
        if ray_node_id is not None:
            self.ray_ids[node_id] = ray_node_id
        if chip is not None:
            self.chips[node_id] = chip
        if store is None:
            return
        since = {folder: nbytes for folder, (at, nbytes) in self._added.get(node_id, {}).items() if at > asked_at}
        self._added[node_id] = {folder: v for folder, v in self._added.get(node_id, {}).items() if folder in since}
        self.stores[node_id] = store
        for folder, nbytes in since.items():
            self._seal(node_id, folder, nbytes)

    def removed(self, node_id: str, folders: list[str]) -> None:
        """Folders gone from the node's store since its last report (for room, or by an operator)."""
        for folder in folders:
            self._added.get(node_id, {}).pop(folder, None)
        store = self.stores.get(node_id)
        if store is not None and folders:
            self.stores[node_id] = store.without(set(folders))

    def added(self, node_id: str, folder: str, nbytes: int, now: float) -> None:
        """A folder copied into the node's store since its last report (a report asked for before
        `now` does not undo it)."""
        self._added.setdefault(node_id, {})[folder] = (now, nbytes)
        self._seal(node_id, folder, nbytes)

    def _seal(self, node_id: str, folder: str, nbytes: int) -> None:
        store = self.stores.get(node_id)
        if store is not None:  # sealed there, and no longer coming in
            fetching = {k: v for k, v in store.fetching.items() if k != folder}
            self.stores[node_id] = store.model_copy(update={"complete": {**store.complete, folder: nbytes}, "fetching": fetching})

    # ---- what it reads ----------------------------------------------------------------------------
    def actor_of(self, ref: InstanceRef) -> str | None:
        return self.actors.get((ref.model, ref.node_id))

    def folder(self, model: str) -> str | None:
        entry = self.entries.get(model)
        return entry.folder if entry is not None else None

    def stored(self, store: StoreReport) -> frozenset[str]:
        """The catalog models whose folder the store holds (L1)."""
        return frozenset(name for name, entry in self.entries.items() if entry.folder is not None and store.holds(entry.folder))

    def holds(self, node_id: str, model: str) -> bool:
        folder, store = self.folder(model), self.stores.get(node_id)
        return folder is not None and store is not None and store.holds(folder)

    def holders(self, model: str, but: str | None = None) -> list[str]:
        """Nodes known to Ray whose store holds the model's folder, by name; `but` left out."""
        folder = self.folder(model)
        if folder is None:
            return []
        return sorted(n for n, s in self.stores.items() if n != but and n in self.ray_ids and s.holds(folder))

    def room(self, node_id: str) -> StoreRoom | None:
        """The store's disk, as rule L4 reads it."""
        store = self.stores.get(node_id)
        if store is None:
            return None
        return StoreRoom(free_bytes=max(0, store.free_bytes), used_bytes=max(0, store.used_bytes), budget_bytes=store.budget_bytes)

    def in_use(self, node_id: str) -> tuple[str, ...]:
        """The store folders of the instances placed on `node_id` (loading or loaded): never removed
        to make room."""
        folders = {self.folder(model) for model, node in self.actors if node == node_id}
        return tuple(sorted(f for f in folders if f is not None))

    def progress(self, model: str, node_id: str) -> str | None:
        """The copy of the model's weights into `node_id`'s store as its agent last reported it, in words."""
        folder, store = self.folder(model), self.stores.get(node_id)
        p = store.fetching.get(folder) if folder is not None and store is not None else None
        if p is None:
            return None
        total = p.total_bytes or 0
        share = f"{100 * p.done_bytes / total:.0f}% ({p.done_bytes / 1e6:.0f} of {total / 1e6:.0f} MB)" if total else f"{p.done_bytes / 1e6:.0f} MB"
        eta = f", about {p.eta_s:.0f} s left" if p.eta_s is not None else ""
        return f"copying from {p.source or '?'}: {share} at {p.bytes_per_s / 1e6:.1f} MB/s{eta}"

    # ---- orders for the effects -------------------------------------------------------------------
    def fetch_order(self, model: str, node_id: str, background: str | None = None) -> FetchOrder:
        """Where the weights come from (L1): a peer whose store holds them, else the Hub for a hub
        model (never for a background copy); what the copy must keep. Nothing to do (`needed` False)
        when the node has no store report, already holds them, or nobody has them."""
        entry = self.entries.get(model)
        store = self.stores.get(node_id)
        if store is None or entry is None or entry.folder is None or store.holds(entry.folder):
            return FetchOrder(model=model, node_id=node_id, entry=entry, root=None)
        keep = self.in_use(node_id)
        if background is not None:
            keep = tuple(sorted({*store.complete, *store.unsealed, *keep}))
        sources = tuple(self.holders(model, but=node_id))
        hub = not sources and entry.hub and background is None
        return FetchOrder(model=model, node_id=node_id, entry=entry, root=store.root, sources=sources, hub=hub, keep=keep, background=background)

    def start_order(self, place: Place, spec: ModelSpec, actor: str, spare: bool = False, measured: MeasuredMemory | None = None) -> StartOrder:
        """Load from the node's store when it holds the folder (a hub model then loads as a local
        folder), else from the registry's own path (every node has it at the same path, as before
        stores; hub models by repo id)."""
        entry = self.entries.get(place.model)
        root = self.stores[place.node_id].root if self.holds(place.node_id, place.model) else None
        if root is not None and entry is not None:
            entry = entry.model_copy(update={"path": entry.folder, "hub": False})
        store = self.stores.get(place.node_id)
        return StartOrder(
            place=place,
            spec=spec,
            entry=entry,
            actor=actor,
            ray_node_id=self.ray_ids.get(place.node_id),
            root=root,
            spare=spare,
            store_root=store.root if store is not None else None,
            measured=measured,
        )
