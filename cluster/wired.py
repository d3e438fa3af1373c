"""The GPU's wired-memory ceiling on a Mac: `sysctl iogpu.wired_limit_mb`, what macOS lets the GPU
keep resident (0: the system's default, Apple's recommended working set). Past it Metal pages or
the machine stalls, so a node never offers more than it (cluster/node_report.py `measure`)."""

import subprocess
import sys

MB = 1 << 20


def parse_wired_limit_mb(text: str) -> int | None:
    """Bytes from `sysctl -n iogpu.wired_limit_mb` (or `sysctl iogpu.wired_limit_mb`'s "name: value"
    line); None for 0 (the default: the recommended working set applies) or text that is no count."""
    value = text.strip().rpartition(":")[2].strip()
    if not value.isdigit():
        return None
    mb = int(value)
    return mb * MB if mb > 0 else None


def wired_limit_bytes(platform: str = sys.platform) -> int | None:
    """This Mac's wired limit when one is set; None elsewhere, or when sysctl does not answer."""
    if platform != "darwin":
        return None
    try:
        out = subprocess.run(["sysctl", "-n", "iogpu.wired_limit_mb"], capture_output=True, text=True, timeout=2)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_wired_limit_mb(out.stdout) if out.returncode == 0 else None
