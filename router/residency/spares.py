"""Spare model-server processes (rule R1): started ahead of demand where a node has room, taken by
the next placement there, and started again in the background.

The policy decides where (`plan_spares`) and counts a spare's memory (`NodeState.spare_bytes`);
this part of the residency loop starts and stops them through the effects and hands a spare to the
placement that the policy credited with it: the placement is carried out in the same loop step as
its decision (`take`), so the spare the state no longer counts belongs to that placement from then
on, and stops with it if it never loads. A spare counts from the moment it starts (the estimate
`spare_bytes`, then what it measured once ready), and a placement may take one that is still
starting: its load waits for that start, which began earlier than a new process would, instead of
starting a second process beside it."""

import asyncio
import logging
from dataclasses import dataclass

from cluster.model_servers import parse_spare_name
from policy import plan_spares
from policy.spares import spare_again, spare_short
from policy.transitions import set_spare
from router.residency.parts import Loop

log = logging.getLogger("orchard.residency")
# How long a load waits for a victim's process to become the node's spare (R1) before it starts a new
# one: becoming one takes a call to the process (0.1 s here), starting one 1 s here and 12 s on a GPU.
RETURN_WAIT_S = 5.0


@dataclass(eq=False)
class Spare:
    actor: str
    bytes: int
    started: asyncio.Task | None = None  # its start, while it runs


class Spares:
    def __init__(self, loop: Loop, retry_s: float = 30.0):
        self.loop = loop
        self.ready: dict[str, Spare] = {}  # node -> its ready spare
        self._starting: dict[str, Spare] = {}  # node -> the spare starting there
        self._promised: dict[str, Spare] = {}  # actor -> a starting spare a placement took
        self._failed: dict[str, float] = {}  # node -> when its last spare failed to start
        self.new_bytes: dict[str, int] = {}  # node -> what its last new spare measured (a process that held models grows)
        self.retry_s = retry_s  # a node whose spare failed to start gets none for this long
        self._returning: dict[str, int] = {}  # node -> victims' processes becoming its spare (`recycle`)
        self._waiting: dict[str, list[asyncio.Future[Spare | None]]] = {}  # node -> loads waiting for one of them (`claim_soon`)

    def plan(self) -> None:
        """R1: start a spare where the policy wants one, stop those it says must go, and put back in
        the state a spare it lost count of (an adoption's placement takes none)."""
        loop, now = self.loop, self.loop.clock.now()
        for node_id, spare in [*self.ready.items(), *self._starting.items()]:
            node = loop.state.node(node_id)
            if node is not None and node.alive and node.spare_bytes != spare.bytes:
                loop.state = set_spare(loop.state, node_id, spare.bytes)
        self._failed = {n: at for n, at in self._failed.items() if now - at < self.retry_s}
        # not beside a load under way on the node (the two would share its cores): once it is done
        loading = frozenset(n.node_id for n in loop.state.nodes if any(i.status == "loading" for i in n.instances))
        busy = frozenset(self._starting) | frozenset(self._failed) | frozenset(self._returning) | loading  # a victim's process returning: no new one
        start, stop = plan_spares(loop.state, loop.config, busy)
        for node_id in stop:
            self.stop(node_id, "its node is short of memory, drained, or spares are off (R1)")
        for node_id in start:
            if node_id not in self.ready:
                spare = self._starting[node_id] = Spare(actor=loop.effects.new_spare_name(node_id), bytes=int(loop.config.spare_bytes))
                loop.state = set_spare(loop.state, node_id, spare.bytes)  # counted from its start
                spare.started = loop._spawn(self._start(node_id, loop.sites.ray_ids.get(node_id), spare))

    def owns(self, actor: str) -> bool:
        """Whether `actor` is a spare of this loop: ready, starting, or taken by a placement whose
        load has not begun."""
        mine = [*self.ready.values(), *self._starting.values()]
        return actor in self._promised or any(s.actor == actor for s in mine) or any(a == actor for a, _ in self.loop.placements.spare_for.values())

    def take(self, node_id: str) -> tuple[str, asyncio.Task | None] | None:
        """The node's spare for the placement the policy credited with it: its actor name, and its
        start while that runs (the load waits for it); None when the node has none."""
        spare = self.ready.pop(node_id, None)
        if spare is not None:
            return spare.actor, None
        spare = self._starting.pop(node_id, None)
        if spare is None:
            return None
        self._promised[spare.actor] = spare
        return spare.actor, spare.started

    async def claim_soon(self, node_id: str) -> str | None:
        """The node's ready spare for a load whose placement was decided without one (`claim`); where
        a victim's process there is becoming the spare (`recycle`), that one once it is, which is
        sooner than a new process (R1); None: the load starts one."""
        claimed = self.claim(node_id)
        if claimed is not None or not self._returning.get(node_id):
            return claimed[0] if claimed is not None else None
        waiter: asyncio.Future[Spare | None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(node_id, []).append(waiter)
        try:
            await asyncio.wait({waiter}, timeout=RETURN_WAIT_S)
        except asyncio.CancelledError:  # its load went away: a process handed to it meanwhile is the node's spare
            if waiter.done() and not waiter.cancelled() and (handed := waiter.result()) is not None:
                self._keep(node_id, handed)
            raise
        finally:
            if not waiter.done():  # timed out or cancelled: no process is handed to it from now on
                waiter.cancel()
                self._waiting[node_id].remove(waiter)
        handed = waiter.result() if not waiter.cancelled() else None
        return handed.actor if handed is not None else None

    async def recycle(self, node_id: str, actor: str, held_bytes: int) -> bool:
        """R1: the stopped model server `actor` of a placement's victim (its model's memory given
        back, `held_bytes` still held) made the node's spare, where the node wants one; False: its
        process is to exit. A load there meanwhile waits for it (`claim_soon`)."""
        if not self.wanted_again(node_id, actor, held_bytes):
            return False
        self._returning[node_id] = self._returning.get(node_id, 0) + 1
        try:
            held = await self.loop.effects.spare_again(actor, self.loop.config.process_models_max)
            return held is not None and self.again(node_id, actor, held)
        finally:
            self._returning[node_id] -= 1
            if not self._returning[node_id]:  # none is coming back: the loads still waiting start their own
                del self._returning[node_id]
                for waiter in self._waiting.pop(node_id, []):
                    waiter.set_result(None)

    def claim(self, node_id: str) -> tuple[str, int] | None:
        """The node's ready spare (not one still starting) for a placement decided without it: its
        actor and bytes, which leave the state (its process is the instance's from now on)."""
        spare = self.ready.pop(node_id, None)
        if spare is None:
            return None
        self.loop.state = set_spare(self.loop.state, node_id, 0)
        return spare.actor, spare.bytes

    def stop(self, node_id: str, reason: str) -> None:
        """Stop the node's spare (or the one starting there): it leaves the state at once."""
        starting = self._starting.pop(node_id, None)
        if starting is not None and starting.started is not None:
            starting.started.cancel()
        spare = self.ready.pop(node_id, None)
        self.loop.state = set_spare(self.loop.state, node_id, 0)
        if spare is not None:
            self.loop._spawn(self.loop.effects.stop_spare(node_id, spare.actor, reason))

    def gone(self, node_id: str) -> None:
        """The node died or is suspect: its spare went with it (a node that comes back has what it
        kept stopped by the adoption, which takes no spare)."""
        starting = self._starting.pop(node_id, None)
        if starting is not None and starting.started is not None:
            starting.started.cancel()
        self.ready.pop(node_id, None)

    def wanted_again(self, node_id: str, actor: str | None, held_bytes: int) -> bool:
        """R1: whether the stopped model server `actor` (its model's memory given back, `held_bytes`
        still held) should become the node's spare instead of exiting: one started as a spare (its
        name says no model), on a node that wants a spare (`spare_again`) and has none ready (one
        still starting there is stopped for it: this process is up now)."""
        node = self.loop.state.node(node_id)
        if actor is None or parse_spare_name(actor) != node_id or node is None or node_id in self.ready:
            return False
        starting = self._starting.get(node_id)  # not yet up: the process that is up now replaces it
        counted = node.model_copy(update={"spare_bytes": 0}) if starting else node
        return spare_again(counted, self.loop.config, held_bytes, self.new_bytes.get(node_id, 0))

    def again(self, node_id: str, actor: str, nbytes: int) -> bool:
        """The stopped model server `actor` became a spare again, holding `nbytes`: the node's ready
        spare from now on if the node still wants one (else False: the caller ends the process)."""
        if not self.wanted_again(node_id, actor, nbytes):
            return False
        if waiting := self._waiting.get(node_id):  # a load there waits for it (`claim_soon`): its process now
            waiting.pop(0).set_result(Spare(actor=actor, bytes=nbytes))
            log.info("%s, a spare again, takes a model on %s at once", actor, node_id)
            return True
        self._keep(node_id, Spare(actor=actor, bytes=nbytes))
        return True

    def _keep(self, node_id: str, spare: Spare) -> None:
        """`spare`, a process that is up, is the node's ready spare (one still starting there stops)."""
        starting = self._starting.pop(node_id, None)
        if starting is not None and starting.started is not None:
            starting.started.cancel()  # its start stops what it started
        self.ready[node_id] = spare
        self.loop.state = set_spare(self.loop.state, node_id, spare.bytes)
        log.info("%s is the spare of %s again (%.0f MiB)", spare.actor, node_id, spare.bytes / 2**20)
        self.loop.placements.offer_spare(node_id)  # a placement there that waits without one takes it
        self.loop._wake()

    def died(self, actor: str) -> None:
        """A ready spare's actor is gone (the watcher): it leaves the state; another starts later."""
        for node_id, spare in list(self.ready.items()):
            if spare.actor == actor:
                del self.ready[node_id]
                self.loop.state = set_spare(self.loop.state, node_id, 0)

    async def _start(self, node_id: str, ray_node_id: str | None, spare: Spare) -> None:
        loop, actor = self.loop, spare.actor
        try:
            nbytes = await loop.effects.start_spare(node_id, ray_node_id, actor)
        except asyncio.CancelledError:
            if self._promised.pop(actor, None) is None:  # a placement that took it waits for this task: its load starts its own
                loop._spawn(loop.effects.stop_spare(node_id, actor, "no longer wanted"))
            raise
        except Exception as e:  # the node is gone, or the process could not start: none there for a while
            log.warning("a spare on %s did not start: %s: %s", node_id, type(e).__name__, e)
            self._failed[node_id] = loop.clock.now()
            if self._starting.get(node_id) is spare:
                del self._starting[node_id]
                loop.state = set_spare(loop.state, node_id, 0)
            if self._promised.pop(actor, None) is None:  # a placement that took it starts a process under its name
                loop._spawn(loop.effects.stop_spare(node_id, actor, "it did not start"))
            return
        if self._promised.pop(actor, None) is not None:  # a placement took it while it started: its load goes on in it
            return
        if self._starting.get(node_id) is not spare:
            return
        del self._starting[node_id]
        node = loop.state.node(node_id)
        if node is None or not node.alive or node.draining:
            loop.state = set_spare(loop.state, node_id, 0)
            loop._spawn(loop.effects.stop_spare(node_id, actor, "its node left or is draining"))
            return
        spare.bytes, spare.started = nbytes, None
        self.new_bytes[node_id] = nbytes
        self.ready[node_id] = spare
        loop.state = set_spare(loop.state, node_id, nbytes)
        log.info("a spare is ready on %s (%s, %.0f MiB)", node_id, actor, nbytes / 2**20)
        if spare_short(loop.state.node(node_id) or node, loop.config):  # measured larger than the room: R1 stops it
            self.plan()
        else:
            loop.placements.offer_spare(node_id)  # a placement there that waits without one takes it
        loop._wake()  # a request waiting for room may fit now
