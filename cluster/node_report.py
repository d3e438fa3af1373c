"""What one node says about itself: devices, chip and memory, measured now.

The arithmetic (`measure`) is a pure function of raw readings so it can be tested on any machine; `probe()`
takes those readings from MLX and psutil, and `read_report()` puts both together for the node agent.

Why a declared budget exists at all: several Ray nodes started on one machine (tests, the local demo) each
read the *whole machine's* RAM, so without a per-node budget three "nodes" would promise three times the
memory there is. A real Mac reports its own unified memory and needs no budget, but may declare one to keep
memory back for other work.
"""

import functools
import platform
import sys
import time
from typing import Any

import psutil
from pydantic import Field

from cluster.wired import wired_limit_bytes
from policy._frozen import Frozen
from policy.cluster_state import InstanceState, NodeState
from policy.specs import DEVICE_KINDS, DeviceKind

GIB = 1 << 30


class Readings(Frozen):
    """Raw numbers as the machine gives them, before any Orchard arithmetic."""

    platform: str  # sys.platform: "darwin", "linux", ...
    device_info: dict[str, Any]  # mx.device_info() (empty if MLX is missing)
    ram_total: int = Field(ge=0)  # psutil.virtual_memory().total
    ram_available: int = Field(ge=0)  # psutil.virtual_memory().available
    mlx_memory_limit: int = Field(default=0, ge=0)  # mx.get_memory_limit(); 0 if unknown
    cpu_model: str = ""
    wired_limit: int | None = Field(default=None, gt=0)  # a Mac's iogpu.wired_limit_mb in bytes, when set (cluster/wired.py)


class Measurement(Frozen):
    """The memory and device part of a NodeReport."""

    devices: tuple[DeviceKind, ...] = Field(min_length=1)
    chip: str
    total_bytes: int = Field(ge=0)
    usable_bytes: int = Field(ge=0)
    free_bytes: int = Field(ge=0)
    budget_bytes: int | None = Field(default=None, gt=0)


class CopyProgress(Frozen):
    """A copy (or download) into a store, as its agent last saw it."""

    done_bytes: int = Field(ge=0)
    total_bytes: int | None = None
    source: str | None = None  # the node it reads from, or the Hub
    bytes_per_s: float = 0.0
    eta_s: float | None = None


class StoreReport(Frozen):
    """A node's model store (cluster/store.py `Store.inventory`) and the copies coming into it:
    folders by name with their bytes."""

    root: str
    free_bytes: int = 0
    budget_bytes: int | None = None
    used_bytes: int = 0
    complete: dict[str, int] = Field(default_factory=dict)
    unsealed: dict[str, int] = Field(default_factory=dict)  # there, not sealed with a manifest yet
    partial: dict[str, int] = Field(default_factory=dict)
    fetching: dict[str, CopyProgress] = Field(default_factory=dict)
    prefix_bytes: int = 0  # what the prefix cache's disk tier holds beside the store (deployments/engines/prefix_disk.py)

    def holds(self, folder: str) -> bool:
        """Whether the folder is there (sealed or not yet)."""
        return folder in self.complete or folder in self.unsealed

    def without(self, folders: list[str] | set[str]) -> "StoreReport":
        """This report with `folders` gone (removed since it was made)."""
        keep = lambda d: {k: v for k, v in d.items() if k not in folders}  # noqa: E731
        return self.model_copy(update={"complete": keep(self.complete), "unsealed": keep(self.unsealed), "partial": keep(self.partial)})


class FetchResult(Frozen):
    """How a node agent's copy or download into its store ended (`NodeAgent.fetch`, `hub_fetch`)."""

    ok: bool
    code: str = ""
    message: str = ""
    bytes: int = 0
    total_bytes: int = 0
    seconds: float = 0.0
    source: str = ""  # the node it read from, "stored" (it was there already), or "hub"
    revision: str | None = None  # the Hub's commit it downloaded
    transport: str | None = None  # "stream" (direct between agents) or "ray" (chunks over Ray calls)
    fallback: str | None = None  # why the stream was not used
    lanes: int = 0  # the stream's connections (cluster/stream.py copy_lanes); 0: none used
    removed: list[str] = Field(default_factory=list)  # folders removed for room (the disk budget)


class NodeReport(Frozen):
    """One node agent's answer: who the node is and its memory, measured at `reported_at`."""

    node_id: str = Field(min_length=1)  # Orchard's name for the node (label orchard.node)
    ray_node_id: str = Field(min_length=1)
    labels: dict[str, str] = Field(default_factory=dict)
    devices: tuple[DeviceKind, ...] = Field(min_length=1)  # the accelerator first, then "cpu"
    chip: str
    total_bytes: int = Field(ge=0)
    # At most what Orchard may use: the Mac's recommended working set, MLX's memory limit on a Linux CPU,
    # the accelerator's memory on CUDA, capped by a declared budget.
    usable_bytes: int = Field(ge=0)
    # Free now as measured (psutil available, or CUDA free memory), capped by budget - Orchard's own use.
    free_bytes: int = Field(ge=0)
    budget_bytes: int | None = Field(default=None, gt=0)
    reported_at: float  # time.time() on the agent's machine
    store: StoreReport | None = None  # the node's model store; None from an agent that has no store

    def node_state(self, instances: tuple[InstanceState, ...] = (), *, draining: bool = False) -> NodeState:
        """The policy's view of this node. The measured free memory becomes the reported headroom;
        foreign use stays 0 because free memory already excludes whatever else runs on the machine."""
        return NodeState(
            node_id=self.node_id,
            labels=self.labels,
            devices=self.devices,
            total_bytes=self.total_bytes,
            usable_bytes=min(self.usable_bytes, self.total_bytes),
            reported_headroom_bytes=self.free_bytes,
            instances=instances,
            draining=draining,
        )


def gib_to_bytes(gib: float) -> int:
    return int(round(float(gib) * GIB))


def measure(
    budget_bytes: int | None,
    readings: Readings,
    *,
    used_by_orchard_bytes: int = 0,
    device_override: DeviceKind | None = None,
) -> Measurement:
    """Pure arithmetic from readings to devices, total, usable and free bytes.

    - Apple Silicon (device_info has memory_size): total = memory_size, usable = the GPU's wired limit
      (`iogpu.wired_limit_mb` where set, else the recommended working set: what Metal may keep resident
      without paging), free = psutil available (unified memory: one pool).
    - CUDA (device_info has total_memory): the accelerator's memory is the pool: total = usable =
      total_memory, free = free_memory.
    - Linux CPU (no memory keys): total = RAM, usable = MLX's memory limit (0.8 x RAM by default), free =
      psutil available.
    A declared budget caps usable, and caps free at budget - what Orchard's instances on this node use
    (the caller tells us that: on one shared machine psutil's figure is the whole machine's).
    """
    if budget_bytes is not None and budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
    if used_by_orchard_bytes < 0:
        raise ValueError(f"used_by_orchard_bytes must be >= 0, got {used_by_orchard_bytes}")
    info = readings.device_info
    if "memory_size" in info:
        detected: DeviceKind = "metal"
        total = int(info["memory_size"])
        # the GPU's wired ceiling: the one set with iogpu.wired_limit_mb, else the recommended working set
        usable = readings.wired_limit or int(info.get("max_recommended_working_set_size") or total)
        free = readings.ram_available
    elif "total_memory" in info:
        detected = "cuda"
        total = int(info["total_memory"])
        usable = total
        free = int(info.get("free_memory", total))
    else:
        detected = "cpu"
        total = readings.ram_total
        limit = readings.mlx_memory_limit
        usable = limit if 0 < limit <= total else total
        free = readings.ram_available
    usable = min(usable, total)
    if budget_bytes is not None:
        usable = min(usable, budget_bytes)
        free = min(free, budget_bytes - used_by_orchard_bytes)
    first = device_override or detected
    if first not in DEVICE_KINDS:
        raise ValueError(f"unknown device {first!r}; expected one of {DEVICE_KINDS}")
    devices: tuple[DeviceKind, ...] = (first,) if first == "cpu" else (first, "cpu")
    chip = str(info.get("device_name") or readings.cpu_model or info.get("architecture") or "unknown")
    return Measurement(
        devices=devices,
        chip=chip,
        total_bytes=max(total, 0),
        usable_bytes=max(usable, 0),
        free_bytes=max(free, 0),
        budget_bytes=budget_bytes,
    )


@functools.lru_cache(maxsize=1)
def _cpu_model() -> str:
    """The CPU's marketing name: /proc/cpuinfo on Linux, sysctl on macOS, else platform's guess."""
    try:
        if sys.platform.startswith("linux"):
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        return line.split(":", 1)[1].strip()
        elif sys.platform == "darwin":
            import subprocess

            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=2)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def probe() -> Readings:
    """Read the machine now. MLX is optional: a node without it is measured as a plain CPU node."""
    vm = psutil.virtual_memory()
    info: dict[str, Any] = {}
    limit = 0
    try:
        import mlx.core as mx

        info = dict(mx.device_info())
        limit = int(mx.get_memory_limit())
    except ImportError:
        pass
    return Readings(
        platform=sys.platform,
        device_info=info,
        ram_total=vm.total,
        ram_available=vm.available,
        mlx_memory_limit=limit,
        cpu_model=_cpu_model(),
        wired_limit=wired_limit_bytes(),
    )


def read_report(
    node_id: str,
    ray_node_id: str,
    labels: dict[str, str],
    budget_bytes: int | None,
    *,
    used_by_orchard_bytes: int = 0,
    device_override: DeviceKind | None = None,
    readings: Readings | None = None,
) -> NodeReport:
    """Measure now (or from given readings) and stamp the result with the node's identity and the time."""
    m = measure(
        budget_bytes,
        readings if readings is not None else probe(),
        used_by_orchard_bytes=used_by_orchard_bytes,
        device_override=device_override,
    )
    return NodeReport(node_id=node_id, ray_node_id=ray_node_id, labels=dict(labels), reported_at=time.time(), **m.model_dump())
