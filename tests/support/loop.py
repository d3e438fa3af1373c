"""The residency loop's test rig: an in-memory Effects (a fake of our own interface, not of Ray: the
Ray effects are exercised by the cluster tests) whose nodes behave like Macs, and a controller on a
clock the tests drive."""

import asyncio

from policy import InstanceRef, Place, PolicyConfig
from policy.config import GIB
from router.residency.clock import ManualClock, MonotonicClock
from router.residency.controller import ResidencyController
from router.residency.events import LoadError, LoadResult

PLAIN = PolicyConfig(
    safety_margin_bytes=0, safety_margin_fraction=0.0, instance_overhead_bytes=0, min_residency_s=0.0, retry_poll_s=0.01, wait_timeout_s=0.2
)


class FakeEffects:
    """A clock the tests drive (an autopilot moves it on while the loop runs, so waits time out
    without real sleeping; `run_for` lets a span of it pass), loads that take no
    time (or fail as told), and a log of every effect. Its nodes behave like Macs: a started
    instance holds its bytes until its stop has ended (its process exited), a node report asked
    for measures what those processes leave free (less `foreign` memory), and a start that would
    not fit beside the processes still there is logged in `overcommits`."""

    def __init__(self):
        self.controller: ResidencyController | None = None
        self.resident: dict[tuple[str, str], int] = {}  # (model, node) -> bytes its process holds
        self.foreign: dict[str, int] = {}  # node -> memory something else took
        self.overcommits: list[tuple[str, str, int]] = []  # (model, node, bytes short) at a start
        self.log: list[tuple[str, str]] = []  # ("start" | "exit", model) in order
        self.stop_gate: asyncio.Event | None = None  # stops end (processes exit) once it is set
        self.stops_exit = True  # False: a stop that cannot confirm its exit
        self.auto_report = True  # a wanted report comes at once
        self.clock: ManualClock | MonotonicClock = ManualClock()
        self._pilot: asyncio.Task | None = None
        self.started: list[Place] = []
        self.stopped: list[tuple[InstanceRef, str]] = []
        self.published = []
        self.fail: dict[str, list[str]] = {}  # model -> reasons for its next loads
        self.gate: asyncio.Event | None = None
        self.versions: dict[str, str] = {}  # model -> its files' version (files_version)
        self.fetched: list[tuple[str, str, int]] = []
        self.background: list[str | None] = []  # each fetch's background reason (None: not a background copy)
        self.fail_fetch: set[str] = set()
        self.fetch_s = 0.01

    def fetch_progress(self, model, node_id):
        return f"copying from n2: 50% of {model}" if any(m == model for m, _, _ in self.fetched) else None

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

    async def start_instance(self, place, spec):
        self.started.append(place)
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
        return LoadResult(bytes=place.bytes, load_seconds=0.5)

    async def stop_instance(self, instance, reason):
        self.stopped.append((instance, reason))
        if self.stop_gate is not None:
            await self.stop_gate.wait()
        if not self.stops_exit:
            return False
        if self.resident.pop((instance.model, instance.node_id), None) is not None:
            self.log.append(("exit", instance.model))
        return True

    def held(self, node_id):
        return sum(n for (_, node), n in self.resident.items() if node == node_id)

    def want_report(self, node_id):
        if self.controller is not None and self.auto_report:
            asyncio.get_running_loop().call_soon(self.report, node_id)

    def report(self, node_id):
        """The node's agent: what the processes there leave free."""
        node = self.controller.state.node(node_id)
        free = node.usable_bytes - self.held(node_id) - self.foreign.get(node_id, 0)
        self.controller.report_node(node_id, devices=node.devices, total_bytes=node.total_bytes, usable_bytes=node.usable_bytes, free_bytes=free)

    def publish(self, event):
        self.published.append(event)

    def files_version(self, model):
        return self.versions.get(model)

    async def fetch_weights(self, model, node_id, background=None):
        self.fetched.append((model, node_id, len(self.stopped)))  # how many stops had happened by then
        self.background.append(background)
        await self.run_for(self.fetch_s)
        if model in self.fail_fetch:
            raise LoadError("error", "copying it failed: sha256 mismatch")


def make(specs, nodes=(("n1", 8), ("n2", 4)), config=PLAIN, real_clock=False):
    """A controller on FakeEffects' driven clock, or with `real_clock` on wall time (for tests that
    run the ingress's side too, whose reports and lingers run on wall time)."""
    effects = FakeEffects()
    if real_clock:
        effects.clock = MonotonicClock()
    c = ResidencyController({s.name: s for s in specs}, config, effects, clock=effects.clock)
    effects.controller = c
    try:
        if not real_clock:
            effects.autopilot()
    except RuntimeError:  # no running loop: a synchronous test
        pass
    for node_id, gb in nodes:
        c.report_node(node_id, devices=("metal", "cpu"), total_bytes=gb * GIB, usable_bytes=gb * GIB, free_bytes=gb * GIB)
    return c, effects


def run(coro):
    return asyncio.run(coro)
