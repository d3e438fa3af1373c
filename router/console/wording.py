"""The residency log and the policy's decisions as sentences a person reads: one function per thing
said, each from the typed value (a ClusterEvent, a Decision), so that the page, its tests and any
other reader say the same thing the same way."""

from deployments.wire.events import ClusterEvent
from policy import Decision, Place, Reject, Use, Wait
from policy.decisions import Blocker, Blockers

MIB = 1024**2
GIB = 1024**3


def size(nbytes: int | float | None) -> str:
    """'1.2 GiB', '300 MiB' or '12 KiB': a size as a person reads it."""
    if nbytes is None:
        return "?"
    if abs(nbytes) >= GIB:
        return f"{nbytes / GIB:.1f} GiB"
    if abs(nbytes) >= MIB:
        return f"{nbytes / MIB:.0f} MiB"
    return f"{nbytes / 1024:.0f} KiB"


def duration(seconds: float | None) -> str:
    """'4.2 s', '3 min' or '2.5 h'."""
    if seconds is None:
        return "?"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _on(event: ClusterEvent) -> str:
    return f" on {event.node_id}" if event.node_id else ""


def _held(event: ClusterEvent) -> str:
    return f" ({size(event.bytes)})" if event.bytes else ""


def _because(reason: str) -> str:
    return f": {reason}" if reason else ""


_UNLOAD_CAUSES = {
    "idle": "it was idle past its idle timeout",
    "operator": "an operator unloaded it",
    "node_dead": "its node died",
    "node_suspect": "its node stopped answering",
    "draining": "its node is draining",
}


def event_sentence(e: ClusterEvent) -> str:
    """One line of the story: what happened, to which model, where, and why (the event's reason)."""
    m, on, held, why = e.model or "?", _on(e), _held(e), _because(e.reason)
    match e.kind:
        case "placed":
            return f"{m} was placed{on}{held}{why}"
        case "loading":
            return f"{m} started loading{on}{held}{why}"
        case "loaded":
            took = f" in {duration(e.seconds)}" if e.seconds is not None else ""
            return f"{m} is loaded{on}{held}{took}{why}"
        case "load_failed":
            return f"{m} failed to load{on}{why}"
        case "retrying":
            return f"{m} will be tried again{why}"
        case "evicted":
            # the reason reads "to place X: <why X goes there>" for a placement's eviction
            return f"{m} was evicted from {e.node_id or '?'}{held} {e.reason}" if e.reason else f"{m} was evicted from {e.node_id or '?'}{held}"
        case "draining":
            return f"{m} is draining{on}{held} to make room{why}"
        case "released":
            return f"{m}{on} gave its memory back{held}; its process exits next{why}"
        case "stopped":
            return f"{m}'s process{on} exited{why}"
        case "unloaded":
            cause = _UNLOAD_CAUSES.get(e.cause or "", e.reason)
            return f"{m} was unloaded{on}{held}" + (f": {cause}" if cause else "")
        case "died":
            return f"{m}{on} died{why}"
        case "rejected":
            return f"a request for {m} was refused{why}"
        case "waiting":
            behind = f" behind {e.node_id}" if e.node_id else ""
            return f"a request for {m} is waiting{behind}{why}"
        case "gave_up":
            return f"a request for {m} gave up{why}"
        case "node_up":
            return f"node {e.node_id} joined{why}"
        case "node_dead":
            return f"node {e.node_id} died{why}"
        case "node_suspect":
            return f"node {e.node_id} stopped answering and is handled as dead{why}"
        case "pinned":
            return f"{m} was pinned: it is never evicted"
        case "unpinned":
            return f"{m} was unpinned: it may be evicted again"
        case "lease_expired":
            return f"a lease on {m}{on} expired{why}"
        case "fetching":
            return f"copying {m}'s weights to {e.node_id or '?'}{held}{why}"
        case "fetched":
            return f"{m}'s weights arrived on {e.node_id or '?'}{why}"
        case "fetch_failed":
            return f"copying {m}'s weights to {e.node_id or '?'} failed{why}"
        case "files_removed":
            return f"{m}'s files were removed{on}{why}"
        case "cancelled":
            return f"{m}{on} was cancelled{why}"
        case "caches_shrunk":
            if e.model is None:  # before X4 named the instance
                return f"the instances{on} gave back their kept prompt prefixes{held}{why}"
            return f"{m}{on} gave back its kept prompt prefixes{held}{why}" if e.bytes else f"{m}{on} gave back no kept prompt prefixes{why}"
    return f"{e.kind}: {m}{on}{why}"  # a kind added later reads plainly until it has its sentence


def _blockers(blockers: Blockers) -> str:
    by: dict[str, list[Blocker]] = {}
    for b in blockers:
        by.setdefault(b.protection, []).append(b)
    parts = []
    for protection, group in by.items():
        names = ", ".join(str(b.instance) for b in group)
        parts.append(f"{protection}: {names} ({size(sum(b.bytes for b in group))})")
    return "; ".join(parts)


def decision_sentence(d: Decision) -> str:
    """What the policy would do, in one sentence (the decision's own message follows it on the page)."""
    if isinstance(d, Use):
        return f"{d.instance.model} is already loaded on {d.instance.node_id}: a request would use it; nothing changes"
    if isinstance(d, Place):
        if not d.evict:
            return f"load {d.model} on {d.node_id} ({d.device}, {size(d.bytes)}), with no eviction"
        victims = ", ".join(f"{r.model} from {r.node_id}" for r in d.evict)
        return f"load {d.model} on {d.node_id} ({d.device}, {size(d.bytes)}) after evicting {victims}"
    if isinstance(d, Wait):
        later = f"; asks again in {duration(d.retry_after_s)}"
        what = "it is loading" if d.code == "loading" else "busy instances stand in the way"
        held = f" ({_blockers(d.blockers)})" if d.blockers else ""
        return f"wait for {d.model}: {what}{held}{later}"
    assert isinstance(d, Reject)
    retry = f"; retry in {duration(d.retry_after_s)}" if d.retry_after_s else ""
    held = f" ({_blockers(d.blockers)})" if d.blockers else ""
    return f"refuse {d.model} ({d.code}){held}{retry}"
