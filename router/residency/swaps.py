"""Swaps (rules W1-W3): an instance drained for a model that busy instances keep out. The drained
instance takes no new request (its standing leases are revoked), the ones in flight finish, and
then it is evicted for the model it drained for. Part of the residency loop: it runs in the loop's
steps and reads and changes the loop's state."""

from collections import Counter, deque

from policy import InstanceRef
from policy.swap import Drain, SwapAsk, pick_swap
from policy.transitions import mark_draining
from router.residency.asks import Ask
from router.residency.parts import Loop


class Swaps:
    def __init__(self, loop: Loop):
        self.loop = loop
        self.drains: dict[InstanceRef, str] = {}  # instance draining for a swap -> the model it makes room for
        self._started: deque[tuple[float, str]] = deque()  # when and where each swap of the last minute started (W2)

    def maybe_swap(self, blocked: dict[str, list[Ask]], now: float) -> None:
        """Start the swap the blocked asks earn, if any (pick_swap decides)."""
        if not blocked:
            return
        asks = [SwapAsk(model=model, waiting=len(queue), waited_s=now - min(a.started for a in queue)) for model, queue in blocked.items()]
        while self._started and now - self._started[0][0] > 60.0:
            self._started.popleft()
        spent = Counter(node for _, node in self._started)
        drain = pick_swap(asks, self.loop.state, now, self.loop.config, swaps_last_minute=spent, draining_for=frozenset(self.drains.values()))
        if drain is not None:
            self._start(drain, now)

    def _start(self, drain: Drain, now: float) -> None:
        loop = self.loop
        self._started.append((now, drain.node_id))
        for ref in drain.instances:
            loop.state = mark_draining(loop.state, ref)
            self.drains[ref] = drain.model
            loop.leases.revoke_all(ref)
            inst = loop._instance(ref)
            loop._record("draining", model=ref.model, node_id=ref.node_id, bytes=inst.bytes if inst else None, reason=drain.reason)
        self.finish()

    def finish(self) -> None:
        """A draining instance with nothing left in flight is evicted for the model it drained for."""
        for ref, asker in list(self.drains.items()):
            inst = self.loop._instance(ref)
            if inst is None or inst.status != "draining":
                del self.drains[ref]
            elif inst.in_flight == 0:
                del self.drains[ref]
                self.loop._drop(ref, "evicted", f"drained for {asker}", f"evicted for {asker}", cause="swap")

    def stop_for(self, model: str) -> None:
        """No ask for `model` waits any more: its drains go back to serving."""
        loop = self.loop
        for ref, asker in list(self.drains.items()):
            if asker == model and loop._instance(ref) is not None:
                del self.drains[ref]
                loop.state = mark_draining(loop.state, ref, False)
                loop._record("cancelled", model=ref.model, node_id=ref.node_id, reason=f"draining stopped: no request for {model} waits any more")
