"""The operator's state that must outlive a residency controller: pins and unpins made at run time,
operator loads, and the event log. Kept in Ray's GCS key-value store (what Ray Serve keeps its own
checkpoints in), namespace "orchard", so a restarted controller replica, or a `serve deploy` of the
same app, finds it again; with a fault-tolerant GCS (external Redis, docs/cluster.md) it also
survives a head restart.

Keys: `pin/<model>` -> true / false (the operator's word over the registry's), `load/<model>` ->
the node asked for (or null), `event/<seq>` -> one ClusterEvent (the last `max_events` are kept).
Every write is one small GCS call; events are placement decisions, never per token.

Pins and operator loads are written in the order their changes were made (rule X2): the caller
starts the write in the same step of the event loop as the change in memory, and one writer thread
runs the writes one after another in that order, so a pin and an unpin close together can never
leave the store saying the reverse of the controller."""

import asyncio
import json
import logging
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ray.experimental import internal_kv

from cluster.ray_api import NAMESPACE
from deployments.wire.events import ClusterEvent

log = logging.getLogger("orchard.residency")


class OperatorStore:
    def __init__(self, app: str = "orchard", max_events: int = 2000, kv: Any = internal_kv):
        self.prefix = f"{app}/"
        self.max_events = max_events
        self.kv = kv  # Ray's GCS key-value store (its internal_kv functions)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orchard-store")  # one: writes in order

    def _ordered(self, fn, *args) -> Awaitable[None]:
        """Run a write on the writer thread after every write started before it (call it on the
        event loop, in the same step as the change it stores)."""
        return asyncio.get_running_loop().run_in_executor(self._writer, fn, *args)

    # ---- raw ---------------------------------------------------------------------------------
    def _key(self, kind: str, name: str) -> str:
        return f"{self.prefix}{kind}/{name}"

    def _put(self, kind: str, name: str, value: Any) -> None:
        try:
            self.kv._internal_kv_put(self._key(kind, name), json.dumps(value), overwrite=True, namespace=NAMESPACE)
        except Exception:  # the GCS unreachable for a moment: the state in memory still holds
            log.exception("could not store %s/%s", kind, name)

    def _all(self, kind: str) -> dict[str, Any]:
        start = self._key(kind, "")
        out: dict[str, Any] = {}
        for key in self.kv._internal_kv_list(start, namespace=NAMESPACE):
            raw = self.kv._internal_kv_get(key, namespace=NAMESPACE)
            if raw is not None:
                out[key.decode()[len(start) :]] = json.loads(raw)
        return out

    # ---- pins --------------------------------------------------------------------------------
    def set_pin(self, model: str, pinned: bool) -> Awaitable[None]:
        return self._ordered(self._put, "pin", model, pinned)

    def pins(self) -> dict[str, bool]:
        return {model: bool(v) for model, v in self._all("pin").items()}

    # ---- operator loads ----------------------------------------------------------------------
    def add_load(self, model: str, node_id: str | None) -> Awaitable[None]:
        return self._ordered(self._put, "load", model, node_id)

    def drop_load(self, model: str) -> Awaitable[None]:
        return self._ordered(self._del, "load", model)

    def _del(self, kind: str, name: str) -> None:
        try:
            self.kv._internal_kv_del(self._key(kind, name), namespace=NAMESPACE)
        except Exception:  # the GCS unreachable for a moment: the state in memory still holds
            log.exception("could not remove %s/%s", kind, name)

    def loads(self) -> dict[str, str | None]:
        return self._all("load")

    # ---- operator pulls (copies into a node's store, until they finish) ------------------------
    def add_pull(self, model: str, node_id: str) -> None:
        self._put("pull", f"{model}@{node_id}", True)

    def drop_pull(self, model: str, node_id: str) -> None:
        self.kv._internal_kv_del(self._key("pull", f"{model}@{node_id}"), namespace=NAMESPACE)

    def pulls(self) -> list[tuple[str, str]]:
        """(model, node) of the pulls that had not finished."""
        return sorted(tuple(key.rsplit("@", 1)) for key in self._all("pull"))  # type: ignore[misc]  # two parts: keys are model@node

    # ---- the event log -----------------------------------------------------------------------
    def on_event(self, event: ClusterEvent) -> None:
        """RayEffects' listener: store the event and drop the one that fell out of the window."""
        self._put("event", f"{event.seq:012d}", event.model_dump(mode="json"))
        if event.seq > self.max_events:
            self.kv._internal_kv_del(self._key("event", f"{event.seq - self.max_events:012d}"), namespace=NAMESPACE)

    def events(self) -> list[ClusterEvent]:
        found = [ClusterEvent.model_validate(v) for v in self._all("event").values()]
        return sorted(found, key=lambda e: e.seq)[-self.max_events :]
