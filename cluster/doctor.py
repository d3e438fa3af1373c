"""`python -m cluster.doctor`: is this machine fit to be an Orchard node? Each check prints one line
(ok, warn or FAIL, and why); the exit status is 1 when any check fails, else 0.

- versions of Python, Ray, MLX, mlx-lm and Orchard here, and against another node's
  (`--expect`: the JSON `--json` prints there, the head's say: Ray refuses to join mismatched Ray
  and Python versions, and the model servers need one MLX);
- the GPU's wired-memory ceiling on a Mac (`iogpu.wired_limit_mb`, else the recommended working set)
  and what it leaves Orchard (docs/residency.md, M3);
- memory pressure (macOS's `kern.memorystatus_vm_pressure_level`; Linux's /proc/pressure/memory);
- free disk where the model store lives (ORCHARD_STORE, else ~/.cache/orchard/models);
- the cluster's Ray token file: a plain file of this user's, mode 0600.

The readings are gathered by `gather()`; `checks()` is pure arithmetic on them, tested anywhere."""

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Literal

from pydantic import Field

from cluster.environment import DEFAULT_DIR, token_path
from cluster.store import ENV_STORE, default_root
from cluster.wired import wired_limit_bytes
from policy._frozen import Frozen

GIB = 1 << 30
PACKAGES = ("ray", "mlx", "mlx-lm", "orchard")
Level = Literal["ok", "warn", "FAIL"]


class Readings(Frozen):
    """What the doctor read of this machine."""

    platform: str
    versions: dict[str, str]  # "python" and each of PACKAGES that is installed
    ram_total: int = Field(ge=0)
    ram_available: int = Field(ge=0)
    recommended_working_set: int | None = None  # a Mac's, from MLX
    wired_limit: int | None = None  # a Mac's iogpu.wired_limit_mb, when set
    pressure: str | None = None  # "normal", "warn", "critical", or Linux PSI's "some avg10=..." line
    store_root: str
    store_free: int | None = None  # bytes free on the store's disk (None: no such folder or parent)
    token_file: str
    token_mode: int | None = None  # st_mode & 0o7777; None: no file
    token_owned: bool = False


class Check(Frozen):
    name: str
    level: Level
    words: str


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def _pressure(system: str) -> str | None:
    try:
        if system == "darwin":
            level = subprocess.run(["sysctl", "-n", "kern.memorystatus_vm_pressure_level"], capture_output=True, text=True, timeout=2)
            return {"1": "normal", "2": "warn", "4": "critical"}.get(level.stdout.strip())
        with open("/proc/pressure/memory") as f:
            return f.readline().strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def gather(temp_root: Path = DEFAULT_DIR) -> Readings:
    """Read this machine now."""
    import psutil

    vm = psutil.virtual_memory()
    recommended = None
    try:
        import mlx.core as mx

        recommended = mx.device_info().get("max_recommended_working_set_size")
    except ImportError:
        pass
    store = Path(os.environ.get(ENV_STORE) or default_root()).expanduser()
    existing = next((p for p in (store, *store.parents) if p.exists()), None)
    token = token_path(temp_root)
    try:
        st = os.lstat(token)
        mode, owned = (st.st_mode & 0o170777), st.st_uid == os.getuid()
    except FileNotFoundError:
        mode, owned = None, False
    return Readings(
        platform=sys.platform,
        versions=_versions(),
        ram_total=vm.total,
        ram_available=vm.available,
        recommended_working_set=int(recommended) if recommended else None,
        wired_limit=wired_limit_bytes(),
        pressure=_pressure(sys.platform),
        store_root=str(store),
        store_free=shutil.disk_usage(existing).free if existing is not None else None,
        token_file=str(token),
        token_mode=mode,
        token_owned=owned,
    )


def checks(r: Readings, expect: dict[str, str] | None = None, min_store_free: int = 20 * GIB) -> list[Check]:
    """Every check's verdict on the readings; `expect`: another node's versions to match."""
    out: list[Check] = []
    mine = ", ".join(f"{k} {v}" for k, v in r.versions.items())
    if expect is None:
        out.append(Check(name="versions", level="ok", words=mine + " (no other node's to compare: --expect)"))
    else:
        differ = [f"{k} {r.versions.get(k, 'missing')} here, {v} there" for k, v in sorted(expect.items()) if r.versions.get(k) != v]
        out.append(
            Check(name="versions", level="FAIL" if differ else "ok", words="; ".join(differ) if differ else f"the same as the other node: {mine}")
        )
    if "mlx" not in r.versions:
        out.append(Check(name="mlx", level="FAIL", words="MLX is not installed: no model can load here"))
    if r.platform == "darwin":
        ceiling = r.wired_limit or r.recommended_working_set
        source = "iogpu.wired_limit_mb" if r.wired_limit else "the recommended working set (iogpu.wired_limit_mb not set)"
        if ceiling is None:
            out.append(Check(name="wired limit", level="warn", words="no wired limit read: is MLX's Metal backend installed?"))
        else:
            level: Level = "warn" if ceiling > 0.9 * r.ram_total else "ok"
            why = ": above 90% of RAM, macOS itself may be squeezed" if level == "warn" else ""
            out.append(
                Check(
                    name="wired limit",
                    level=level,
                    words=f"{ceiling / GIB:.1f} GiB of {r.ram_total / GIB:.0f} GiB from {source}: Orchard plans within it{why}",
                )
            )
    pressure = r.pressure or "unknown"
    if pressure.startswith("some avg10="):
        busy = float(dict(part.split("=", 1) for part in pressure.split()[1:])["avg10"])
        level = "FAIL" if busy >= 10 else "warn" if busy >= 1 else "ok"
        out.append(
            Check(
                name="memory pressure",
                level=level,
                words=f"{busy:.2f}% of the last 10 s stalled on memory; {r.ram_available / GIB:.1f} GiB available",
            )
        )
    else:
        levels: dict[str, Level] = {"normal": "ok", "warn": "warn", "critical": "FAIL"}
        level = levels.get(pressure, "warn")
        out.append(Check(name="memory pressure", level=level, words=f"{pressure}; {r.ram_available / GIB:.1f} GiB available"))
    if r.store_free is None:
        out.append(Check(name="store disk", level="FAIL", words=f"{r.store_root}: no such folder nor parent"))
    else:
        level = "ok" if r.store_free >= min_store_free else "warn"
        out.append(
            Check(name="store disk", level=level, words=f"{r.store_free / GIB:.1f} GiB free for {r.store_root} (want {min_store_free / GIB:.0f})")
        )
    if r.token_mode is None:
        out.append(Check(name="token file", level="warn", words=f"{r.token_file}: none (made when this node starts its cluster)"))
    elif r.token_mode != 0o100600 or not r.token_owned:
        out.append(
            Check(
                name="token file",
                level="FAIL",
                words=f"{r.token_file}: mode {r.token_mode & 0o7777:o}, {'yours' if r.token_owned else 'not yours'}: must be a plain file of yours, mode 600",
            )
        )
    else:
        out.append(Check(name="token file", level="ok", words=f"{r.token_file}: yours, mode 600"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.doctor", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="the cluster's temp dir (its token file)")
    parser.add_argument("--expect", type=Path, help="another node's `--json` output to compare versions with")
    parser.add_argument("--json", action="store_true", help="print the readings as JSON (for another node's --expect)")
    args = parser.parse_args(argv)
    readings = gather(args.dir)
    if args.json:
        print(readings.model_dump_json(indent=2))
        return 0
    expect = json.loads(args.expect.read_text())["versions"] if args.expect else None
    found = checks(readings, expect)
    for c in found:
        print(f"{c.level:4} {c.name:16} {c.words}")
    return 1 if any(c.level == "FAIL" for c in found) else 0


if __name__ == "__main__":
    sys.exit(main())
