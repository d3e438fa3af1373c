"""The residency loop's test rig: an in-memory Effects (a fake of our own interface, not of Ray: the
Ray effects are exercised by the cluster tests) whose nodes behave like Macs, and a controller on a
clock the tests drive."""

import asyncio

from cluster.model_servers import spare_name
from cluster.node_report import CopyProgress, FetchResult, StoreReport
from deployments.manifest import ManifestEntry
from deployments.wire.measured import MeasuredMemory
from deployments.wire.reports import Released
from policy import InstanceRef, Place, PolicyConfig
from policy.config import GIB
from router.residency.clock import ManualClock, MonotonicClock
from router.residency.controller import ResidencyController
from router.residency.events import CachesReported, LoadError, LoadResult

PLAIN = PolicyConfig(
    safety_margin_bytes=0,
    safety_margin_fraction=0.0,
    instance_overhead_bytes=0,
    min_residency_s=0.0,
    residency_per_reload=0.0,
    retry_poll_s=0.01,
    wait_timeout_s=0.2,
    spares_per_node=0,  # rule R1's tests turn spares on
)


class FakeEffects:
    """A clock the tests drive (an autopilot moves it on while the loop runs, so waits time out
    without real sleeping; `run_for` lets a span of it pass), loads that take no
    time (or fail as told), and a log of every effect. Its nodes behave like Macs: a started
    instance holds its bytes until its model server released them (then `residual`) and what is
    left until its stop has ended (its process exited), a node report asked
    for measures what those processes leave free (less `foreign` memory), and a start that would
    not fit beside the processes still there is logged in `overcommits`."""

    def __init__(self):
        self.controller: ResidencyController | None = None
        self.resident: dict[tuple[str, str], int] = {}  # (model, node) -> bytes its process holds
        self.foreign: dict[str, int] = {}  # node -> memory something else took
        self.overcommits: list[tuple[str, str, int]] = []  # (model, node, bytes short) at a start
        self.log: list[tuple[str, str]] = []  # ("start" | "exit", model) in order
        self.stop_gate: asyncio.Event | None = None  # stops end (processes exit) once it is set
        self.releases = True  # a stopping model server gives its model's memory back before it exits (X1); False: no answer
        self.release_gate: asyncio.Event | None = None  # releases end once it is set
        self.residual = GIB // 4  # what a process that released its model holds until it exits
        self.stops_exit = True  # False: a stop that cannot confirm its exit
        self.auto_report = True  # a wanted report comes at once
        self.clock: ManualClock | MonotonicClock = ManualClock()
        self._pilot: asyncio.Task | None = None
        self.started: list[Place] = []
        self.stopped: list[tuple[InstanceRef, str]] = []
        self.published = []
        self.fail: dict[str, list[str]] = {}  # model -> reasons for its next loads
        self.measured: dict[str, MeasuredMemory] = {}  # model -> what its engine measures after a load (M1)
        self.gate: asyncio.Event | None = None
        self.versions: dict[str, str] = {}  # model -> its files' version (files_version)
        self.fetched: list[tuple[str, str, int]] = []
        self.background: list[str | None] = []  # each fetch's background reason (None: not a background copy)
        self.fail_fetch: set[str] = set()
        self.fetch_s = 0.01
        self._incarnations = 0
        self.caches: dict[tuple[str, str], int] = {}  # (model, node) -> bytes its kept prompt prefixes hold
        self.stuck: set[str] = set()  # models whose shrink gives nothing back (no answer in time)
        self.shrunk: list[list[str]] = []  # each shrink_caches call's actors
        self.spares: dict[str, tuple[str, int]] = {}  # spare actor -> (node, bytes its process holds) (R1)
        self.spare_size = GIB // 4
        self.spare_gate: asyncio.Event | None = None  # spares start once it is set
        self.spare_starts: list[str] = []  # the spares whose start_instance took them
        self.no_spare_again = False  # spare_again answers None (R1: the process will not be a spare again)
        self.spare_again_gate: asyncio.Event | None = None  # spare_again answers once it is set
        self.actors: dict[tuple[str, str], str] = {}  # (model, node) -> the actor its start_instance ran in

    def now(self) -> float:
        return self.clock.now()

    def autopilot(self) -> None:
        """Move the clock on by 2 ms every few turns of the loop, while the test runs."""

        async def drive():
            while True:
                for _ in range(4):
                    await asyncio.sleep(0)
                self.clock.advance(0.002)

        if self._pilot is None:
            self._pilot = asyncio.get_running_loop().create_task(drive())

    async def run_for(self, seconds: float) -> None:
        """Let `seconds` of the clock pass with the loop running."""
        end = self.clock.now() + seconds
        while self.clock.now() < end:
            await asyncio.sleep(0)

    def new_spare_name(self, node_id):
        self._incarnations += 1
        return spare_name(node_id, str(self._incarnations))

    async def spare_again(self, actor, max_models):
        """R1: a stopped model server started as a spare is one again, holding what it kept after
        its release (`residual`), unless `no_spare_again`."""
        self.log.append(("spare_again", actor))
        if self.spare_again_gate is not None:
            await self.spare_again_gate.wait()
        if self.no_spare_again:
            return None
        for (model, node_id), held in list(self.resident.items()):
            if self.actors.get((model, node_id)) == actor:
                del self.resident[(model, node_id)]
                self.spares[actor] = (node_id, held)
                return held
        return None

    async def start_spare(self, node_id, ray_node_id, actor):
        """A spare process (R1): it holds `spare_size` bytes from its start until its stop, or until
        a placement takes it (then its instance's bytes hold it)."""
        self.log.append(("spare", node_id))
        if self.spare_gate is not None:
            await self.spare_gate.wait()
        await asyncio.sleep(0)
        self.spares[actor] = (node_id, self.spare_size)
        return self.spare_size

    async def stop_spare(self, node_id, actor, reason):
        self.log.append(("spare_stopped", node_id))
        self.spares.pop(actor, None)

    def new_actor_name(self, model, node_id):
        self._incarnations += 1
        return f"{model}@{node_id}#{self._incarnations}"

    async def start_instance(self, order):
        place = order.place
        if order.spare:  # its process is the spare's: its bytes are the instance's from now on
            assert self.spares.pop(order.actor, None) is not None, f"{order.actor} is no spare"
            self.spare_starts.append(order.actor)
        self.started.append(place)
        self.actors[(place.model, place.node_id)] = order.actor
        self.log.append(("start", place.model))
        node = self.controller.state.node(place.node_id) if self.controller else None
        if node is not None:
            short = self.held(place.node_id) + self.foreign.get(place.node_id, 0) + place.bytes - node.usable_bytes
            if short > 0:
                self.overcommits.append((place.model, place.node_id, short))
        self.resident[(place.model, place.node_id)] = place.bytes
        if self.gate is not None:
            await self.gate.wait()
        await asyncio.sleep(0)
        reasons = self.fail.get(place.model)
        if reasons:
            raise LoadError(reasons.pop(0), "simulated")
        return LoadResult(bytes=place.bytes, load_seconds=0.5, measured=self.measured.get(place.model))

    async def release_instance(self, instance, actor, reason):
        """X1: the model server drops its model and caches; its process holds `residual` from then
        until its exit, as a Mac's would."""
        if actor is None or not self.releases:
            return None
        if self.release_gate is not None:
            await self.release_gate.wait()
        key = (instance.model, instance.node_id)
        held = self.resident.get(key)
        if held is None:
            return None
        held += self.caches.pop(key, 0)
        self.resident[key] = min(held, self.residual)
        self.log.append(("release", instance.model))
        return Released(process_before_bytes=held, process_bytes=self.resident[key], mlx_bytes=0, seconds=0.0)

    async def stop_instance(self, instance, actor, reason):
        self.stopped.append((instance, reason))
        if self.stop_gate is not None:
            await self.stop_gate.wait()
        if not self.stops_exit:
            return False
        self.caches.pop((instance.model, instance.node_id), None)  # its kept prefixes go with its process
        if self.resident.pop((instance.model, instance.node_id), None) is not None:
            self.log.append(("exit", instance.model))
        return True

    async def shrink_caches(self, actors):
        """The instances' kept prefixes (`caches`), memory their processes hold until given back."""
        self.shrunk.append(sorted(actors))
        freed = 0
        for actor in actors:
            model, node_id = actor.split("#")[0].split("@")
            if model not in self.stuck:
                freed += self.caches.pop((model, node_id), 0)
        return freed

    def report_caches(self, node_id):
        """The watcher's round: each instance's memory report, its kept prefixes (X4)."""
        held = {m: n for (m, node), n in self.caches.items() if node == node_id}
        self.controller.apply(CachesReported(node_id=node_id, prefix_cache_bytes=held))

    async def store_report(self, node_id):
        return None  # the store as the last report said

    async def remove_files(self, node_id, folder):
        self.log.append(("remove", folder))
        return True

    def held(self, node_id):
        """What the processes there hold: what they loaded and their kept prefixes."""
        spares = sum(n for node, n in self.spares.values() if node == node_id)
        return spares + sum(n for (_, node), n in (*self.resident.items(), *self.caches.items()) if node == node_id)

    def want_report(self, node_id):
        if self.controller is not None and self.auto_report:
            asyncio.get_running_loop().call_soon(self.report, node_id)

    def report(self, node_id, store=None):
        """The node's agent: what the processes there leave free (and its store, when given)."""
        node = self.controller.state.node(node_id)
        free = node.usable_bytes - self.held(node_id) - self.foreign.get(node_id, 0)
        self.controller.report_node(
            node_id, devices=node.devices, total_bytes=node.total_bytes, usable_bytes=node.usable_bytes, free_bytes=free, store=store
        )

    def publish(self, event):
        self.published.append(event)

    def files_version(self, model):
        return self.versions.get(model)

    async def fetch_weights(self, order):
        model, node_id = order.model, order.node_id
        self.fetched.append((model, node_id, len(self.stopped)))  # how many stops had happened by then
        self.background.append(order.background)
        if self.controller is not None:  # the agent's next report shows the copy half done
            stored = dict.fromkeys(self.controller.state.node(node_id).stored, 1)
            self.report(
                node_id, StoreReport(root="/store", complete=stored, fetching={model: CopyProgress(done_bytes=50, total_bytes=100, source="n2")})
            )
        await self.run_for(self.fetch_s)
        if model in self.fail_fetch:
            return FetchResult(ok=False, code="io_error", message="sha256 mismatch")
        return FetchResult(ok=True, source="stored")


def make(specs, nodes=(("n1", 8), ("n2", 4)), config=PLAIN, real_clock=False):
    """A controller on FakeEffects' driven clock, or with `real_clock` on wall time (for tests that
    run the ingress's side too, whose reports and lingers run on wall time)."""
    effects = FakeEffects()
    if real_clock:
        effects.clock = MonotonicClock()
    c = ResidencyController({s.name: s for s in specs}, config, effects, entries=entries_for(specs), clock=effects.clock)
    effects.controller = c
    try:
        if not real_clock:
            effects.autopilot()
    except RuntimeError:  # no running loop: a synchronous test
        pass
    for node_id, gb in nodes:
        c.report_node(node_id, devices=("metal", "cpu"), total_bytes=gb * GIB, usable_bytes=gb * GIB, free_bytes=gb * GIB)
    return c, effects


def entries_for(specs) -> dict[str, ManifestEntry]:
    """Registry entries for the specs, each model in a store folder of its own name."""
    return {
        s.name: ManifestEntry(
            name=s.name, kind=s.kind, path=s.name, folder=s.name, weight_bytes=s.weight_bytes, weights="random", architecture="x", source="x"
        )
        for s in specs
    }


def run(coro):
    return asyncio.run(coro)
