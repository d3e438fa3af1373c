"""Load Debian's OpenBLAS before MLX on Linux: the mlx[cpu] wheel's bundled reference BLAS is 5-50x
slower for the matmuls that dominate inference (../shared/models/README.md). Loading the library
with RTLD_GLOBAL first makes libmlx's cblas_sgemm resolve to it. No-op on macOS or when absent."""

import ctypes
import os
import sys

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
_loaded: bool | None = None


def preload_openblas() -> bool:
    """Returns whether OpenBLAS is in use. Must run before the first `import mlx.core`."""
    global _loaded
    if _loaded is not None:
        return _loaded
    _loaded = False
    if sys.platform != "linux" or not os.path.exists(OPENBLAS):
        return _loaded
    if "mlx.core" in sys.modules:
        return _loaded  # too late: MLX already bound its BLAS
    # One thread beat two on the 2-core machines here; an operator may set more.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    ctypes.CDLL(OPENBLAS, mode=ctypes.RTLD_GLOBAL)
    _loaded = True
    return _loaded
