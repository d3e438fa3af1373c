"""Where a prompt of a model can be counted now (Anthropic's count_tokens), read from what the loop
knows and changing none of it: no ask is queued, nothing is placed, loaded or evicted, and no
demand is counted, so a count costs no swap and never waits for room.

A ready instance's model server counts with its engine's own tokenizer. Without one, a node agent
counts with the tokenizer files of the model's folder (deployments/engines/prompt_tokens.py): first
on nodes whose store holds the folder (its path there), then, for a model that is not a Hub repo,
at the registry's own path, which a model server loads from where no store holds the folder (as
`Sites.start_order` does). A Hub model that no store holds has no files to count with."""

from pathlib import Path

from deployments.manifest import ManifestEntry, model_location
from deployments.wire.counting import CountSite, TokenizerSite
from deployments.wire.failure import OrchardError
from policy import ClusterState, InstanceRef
from router.residency.sites import Sites


def count_site(model: str, entries: dict[str, ManifestEntry], state: ClusterState, sites: Sites, models_dir: str) -> CountSite:
    """Where to count `model`'s prompts (see above); OrchardError model_not_found for a model not
    in the registry, files_not_stored when no instance is ready and no node has its files."""
    entry = entries.get(model)
    if entry is None:
        raise OrchardError("model_not_found", f"The model '{model}' does not exist", "model")
    alive = sorted((n for n in state.nodes if n.alive), key=lambda n: n.node_id)
    ready = [(i.in_flight, n.node_id) for n in alive for i in n.instances if i.model == model and i.status == "ready"]
    actor = sites.actor_of(InstanceRef(node_id=min(ready)[1], model=model)) if ready else None
    folders = []
    for node in alive:
        store = sites.stores.get(node.node_id)
        if entry.folder is not None and store is not None and sites.holds(node.node_id, model):
            folders.append(TokenizerSite(node_id=node.node_id, folder=str(Path(store.root) / entry.folder)))
    if not entry.hub:
        held = {f.node_id for f in folders}
        folders += [TokenizerSite(node_id=n.node_id, folder=model_location(entry, models_dir)) for n in alive if n.node_id not in held]
    if actor is None and not folders:
        raise OrchardError(
            "files_not_stored",
            f"model {model} is not loaded and no node holds its files to count its tokens with (count_tokens loads nothing)",
            "model",
        )
    return CountSite(model=model, kind=entry.kind, tool_parser=entry.tool_parser, reasoning=entry.reasoning, actor_name=actor, folders=folders)
