"""The asks waiting in the residency loop, one queue per model, and the one decision per ask.

An ask is a request (for a lease: `acquire`) or an operator's load (for a ready instance, anywhere
or on a named node: `load`). Every change of state decides each queued ask once, oldest first in
its queue, with the same policy call (`ensure`, or `place_on` for a named node): it is answered
(a lease, an instance, or the policy's refusal as an OrchardError), or it waits; an ask that busy
instances keep out is a candidate for a swap (swaps.py). Part of the residency loop: it runs in
the loop's steps and reads and changes the loop's state."""

import asyncio
from collections import deque
from dataclasses import dataclass

from deployments.wire.failure import OrchardError
from policy import InstanceRef, Place, Reject, Use, Wait, ensure
from policy.decisions import Decision
from policy.failures import reject_marked
from policy.on_node import place_on
from router.residency.parts import Loop


@dataclass(eq=False)
class Ask:
    """A request (for a lease) or an operator's load (for a ready instance) in its model's queue."""

    model: str
    started: float
    future: asyncio.Future
    holder: str | None = None  # an ingress replica asking for a standing lease
    operator: bool = False
    node_id: str | None = None  # an operator's load on this node
    avoid: tuple[str, float] | None = None  # (node, loaded_at): an incarnation the request just left
    announced: bool = False  # its `waiting` event is recorded
    placed: bool = False  # an operator's load on a node: its placement was started
    busy_blocked: bool = False  # its last decision: busy instances keep it out


class Asks:
    def __init__(self, loop: Loop):
        self.loop = loop
        self.queues: dict[str, deque[Ask]] = {}

    def add(self, ask: Ask) -> None:
        self.queues.setdefault(ask.model, deque()).append(ask)

    def left(self, ask: Ask) -> bool:
        """Take out an ask nobody waits for any more (its client went away); True when it was its
        model's last."""
        queue = self.queues.get(ask.model)
        if queue is None or ask not in queue:
            return False
        queue.remove(ask)
        if queue:
            return False
        del self.queues[ask.model]
        return True

    def decide_all(self, now: float) -> None:
        """Decide every queued ask once against the current state, oldest first in each queue."""
        for model in list(self.queues):
            queue = self.queues[model]
            for ask in list(queue):
                if ask.future.done() or self.decide(ask, now):
                    queue.remove(ask)
            if not queue:
                del self.queues[model]

    def blocked(self) -> dict[str, list[Ask]]:
        """The asks, by model, that busy instances kept out at their last decision (W1)."""
        return {model: blocked for model, queue in self.queues.items() if (blocked := [a for a in queue if a.busy_blocked and not a.future.done()])}

    def what_if(self, model: str, node_id: str | None, now: float) -> Decision:
        """What `decide` would be answered now for such an ask, carried out nowhere."""
        loop = self.loop
        if node_id is not None:
            return place_on(model, node_id, loop.state, now, loop.config)
        return ensure(model, loop.state, now, loop.config, exclude_nodes=loop.removals.on(model))

    def decide(self, ask: Ask, now: float) -> bool:
        """One decision for one ask; True when it is answered (a lease, an instance or an error)."""
        try:
            return self._decide_on_node(ask, now) if ask.node_id is not None else self._decide_anywhere(ask, now)
        except OrchardError as e:
            ask.future.set_exception(e)
            return True

    def _decide_anywhere(self, ask: Ask, now: float) -> bool:
        model = ask.model
        ask.busy_blocked = False
        self.loop._retry_if_files_changed(model)
        for _ in range(3):  # a Place is applied to the state at once: decide again on the new state
            decision = ensure(model, self.loop.state, now, self.loop.config, waited_s=now - ask.started, exclude_nodes=self.loop.removals.on(model))
            if not isinstance(decision, Place):
                break
            if not self.loop.placements.begin(decision, for_requests=not ask.operator):
                return self._waiting_for_fetch(ask, decision, now)
        if isinstance(decision, Use):
            return self._use(ask, decision.instance, now)
        if self._waits_for_revoked(decision, ask.started, now):
            self.loop._schedule(self.loop.config.retry_poll_s)
            return False
        if isinstance(decision, Wait):
            ask.busy_blocked = decision.code == "busy"
            if ask.busy_blocked and not ask.announced:
                ask.announced = True
                blocker = decision.blockers.node_ids[0] if decision.blockers else None
                self.loop._record("waiting", model=model, node_id=blocker, reason=decision.message)
            self.loop._schedule(min(decision.retry_after_s, self.loop.config.swap_after_s) if ask.busy_blocked else decision.retry_after_s)
            return False
        if isinstance(decision, Place):  # still placing after three rounds: wait for the loads
            return False
        assert isinstance(decision, Reject)
        if self.loop.removals.on(model):  # X3: refused only while its files leave a node: decide again after
            self.loop._schedule(self.loop.config.retry_poll_s)
            return False
        if decision.code == "unknown_model":
            pass  # a 404, not a placement decision: names a client made up stay out of the log
        elif ask.announced:
            waited = now - ask.started
            self.loop._record("gave_up", model=model, reason=f"after waiting {waited:.1f} s: {decision.message}", seconds=waited)
        else:
            self.loop._record("rejected", model=model, reason=decision.message)
        raise error_for(decision)

    def _use(self, ask: Ask, ref: InstanceRef, now: float) -> bool:
        inst = self.loop._instance(ref)
        assert inst is not None  # a Use names an instance the state holds
        if ask.operator:
            ask.future.set_result(ref)
            return True
        if ask.avoid == (ref.node_id, inst.loaded_at) and now - ask.started < self.loop.revoke_grace_s:
            self.loop._schedule(self.loop.config.retry_poll_s)  # its death is being confirmed: another decision then
            return False
        lease = self.loop.leases.grant(ref, inst.loaded_at, ask.holder, now)
        self.loop._count(ref, now)
        ask.future.set_result(lease)
        return True

    def _decide_on_node(self, ask: Ask, now: float) -> bool:
        """An operator's load on one node (P11): an extra copy there, within max_copies."""
        model, node_id = ask.model, ask.node_id
        assert node_id is not None
        decision = place_on(model, node_id, self.loop.state, now, self.loop.config)
        if isinstance(decision, Use):
            ask.future.set_result(decision.instance)
            return True
        if isinstance(decision, Wait) or (model, node_id) in self.loop.placements.prefetches:
            return False  # loading there (its LoadDone decides again), or its weights arrive first
        if isinstance(decision, Reject) and decision.code in ("unknown_model", "no_node"):
            raise error_for(decision)
        mark = self.loop.state.failed.get(model)
        if mark is not None and mark.at >= ask.started:
            raise error_for(reject_marked(mark, now, self.loop.config))
        node = self.loop.state.node(node_id)
        if ask.placed and node is not None and model not in node.stored:
            raise OrchardError("model_unloaded", f"model {model} left {node_id} before it was ready")
        if (model, node_id) in self.loop.removals.pending:
            raise OrchardError("files_in_use", f"the files of {model} are being removed from {node_id}'s store: load it there after", "node")
        if isinstance(decision, Place):
            ask.placed = self.loop.placements.begin(decision)
            return False
        assert isinstance(decision, Reject)
        revoking = any(self.loop.leases.revoke_idle_each(decision.blockers.keys_of("busy")))
        if decision.code == "blocked" and revoking and now - ask.started < self.loop.revoke_grace_s:
            self.loop._schedule(self.loop.config.retry_poll_s)  # idle standing leases in the way come back
            return False
        if decision.code == "blocked":
            self.loop._record("rejected", model=model, node_id=node_id, reason=decision.message)
        raise error_for(decision)

    def _waiting_for_fetch(self, ask: Ask, place: Place, now: float) -> bool:
        """A request whose placement waits for the weights to arrive first: as `contention` says, a
        503 at once (`fail`) or a wait up to wait_timeout_s (`wait`), the copy's progress in the
        message either way. True when answered."""
        if ask.operator:
            return False
        progress = self.loop.sites.progress(place.model, place.node_id)
        what = f"model {place.model} waits for its weights on {place.node_id} before placing it ({place.reason})"
        message = f"{what}: {progress}" if progress else what
        waited = now - ask.started
        if self.loop.config.contention == "wait" and waited < self.loop.config.wait_timeout_s:
            self.loop._schedule(self.loop.config.retry_poll_s)  # to see the timeout pass
            return False
        if self.loop.config.contention == "wait":
            self.loop._record("gave_up", model=place.model, node_id=place.node_id, reason=f"after waiting {waited:.1f} s: {message}", seconds=waited)
            raise OrchardError("model_gave_up", f"gave up after waiting {waited:.0f} s: {message}", retry_after_s=self.loop.config.retry_poll_s)
        raise OrchardError("model_fetching", message, retry_after_s=self.loop.config.retry_poll_s)

    def _waits_for_revoked(self, decision: Decision, started: float, now: float) -> bool:
        """Revoke the idle standing leases that keep the decision's busy blockers busy; True when a
        refusal should wait for them instead (contention "fail", within revoke_grace_s)."""
        if not isinstance(decision, Wait | Reject) or decision.code != "busy":
            return False
        pending = list(self.loop.leases.revoke_idle_each(decision.blockers.keys_of("busy")))
        return any(pending) and isinstance(decision, Reject) and now - started < self.loop.revoke_grace_s


def error_for(reject: Reject) -> OrchardError:
    """The policy's refusal as the one failure type, with its status code's name."""
    if reject.code == "unknown_model":
        return OrchardError("model_not_found", reject.message, "model")
    if reject.code == "no_node":
        return OrchardError("node_not_found", reject.message)
    if reject.code == "max_copies":
        return OrchardError("model_already_loaded", reject.message)
    return OrchardError(f"model_{reject.code}", reject.message, retry_after_s=reject.retry_after_s)
