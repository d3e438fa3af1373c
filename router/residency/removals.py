"""Store folders leaving nodes: an operator's removal (rule X3), checked and marked in one step of
the loop so no placement slips in on the files being removed, and folders gone for room (a copy's
disk budget). Part of the residency loop: it runs in the loop's steps and reads and changes the
loop's state."""

from deployments.wire.failure import OrchardError
from policy.transitions import mark_unstored
from router.residency.parts import Loop


class Removals:
    def __init__(self, loop: Loop):
        self.loop = loop
        self.pending: set[tuple[str, str]] = set()  # (model, node) whose files an operator removes (X3)

    async def remove(self, model: str, node_id: str, force: bool = False) -> bool:
        """An operator's removal of the model's folder from one node's store: not while a model
        using that folder is on the node (loading, waiting to load or loaded) or being copied in,
        and no placement chooses that node for those models until the removal has ended (X3); not
        the cluster's last stored copy unless `force`. True when the agent removed it."""
        sites = self.loop.sites
        folder, store = sites.folder(model), sites.stores.get(node_id)
        if store is None:
            raise OrchardError("node_not_found", f"no store report from node {node_id}", "node")
        if folder is None or not (store.holds(folder) or folder in store.partial):
            raise OrchardError("files_not_stored", f"node {node_id}'s store does not hold the files of {model}", "node")
        users = frozenset(name for name, entry in sites.entries.items() if entry.folder == folder)
        self.begin(node_id, users)  # checked and marked in this step: no placement slips in
        removed = False
        try:
            if not force and not sites.entries[model].hub and store.holds(folder) and not sites.holders(model, but=node_id):
                message = f"node {node_id} holds the cluster's last stored copy of {folder}: pass force=true to remove it anyway"
                raise OrchardError("last_stored_copy", message, "force")
            removed = await self.loop.effects.remove_files(node_id, folder)
        finally:
            self.end(node_id, users, removed)
        if removed:
            self.gone(node_id, [folder], "by an operator")
        return removed

    def begin(self, node_id: str, models: frozenset[str]) -> None:
        """An operator removes a folder from `node_id`'s store that `models` load from (X3): refused
        (409 files_in_use) while one of them is on the node, its weights are being copied there, or
        the folder is already being removed; else no placement chooses that node for them until
        `end`."""
        node = self.loop.state.node(node_id)
        on_node = sorted(i.model for i in node.instances if i.model in models) if node is not None else []
        if on_node:
            loading = [m for m in on_node if node is not None and (i := node.instance(m)) is not None and i.status == "loading"]
            what = "is loading" if loading else "is"
            raise OrchardError(
                "files_in_use",
                f"{', '.join(on_node)} {what if len(on_node) == 1 else 'are'} on {node_id} from these files"
                + (" (a placement in progress)" if loading else "")
                + ": unload first",
                "node",
            )
        copying = sorted(m for m, n in self.loop.placements.prefetches if n == node_id and m in models)
        if copying:
            raise OrchardError("files_in_use", f"the weights of {', '.join(copying)} are being copied to {node_id} for a placement", "node")
        if any((m, node_id) in self.pending for m in models):
            raise OrchardError("files_in_use", f"these files are already being removed from {node_id}", "node")
        self.pending.update((m, node_id) for m in models)

    def end(self, node_id: str, models: frozenset[str], removed: bool) -> None:
        loop = self.loop
        self.pending.difference_update((m, node_id) for m in models)
        if removed and loop.state.node(node_id) is not None:
            loop.state = mark_unstored(loop.state, node_id, models)
        loop._wake()

    def on(self, model: str) -> frozenset[str]:
        """The nodes the model's files are being removed from."""
        return frozenset(n for m, n in self.pending if m == model)

    def gone(self, node_id: str, folders: list[str], reason: str) -> None:
        """Folders gone from the node's store (for room, or by an operator): the view at once, not at
        the next report, and one event each."""
        sites = self.loop.sites
        sites.removed(node_id, folders)
        for folder in folders:
            owner = next((name for name, entry in sites.entries.items() if entry.folder == folder), None)
            self.loop._record("files_removed", model=owner, node_id=node_id, reason=f"{folder} removed from the store {reason}")
