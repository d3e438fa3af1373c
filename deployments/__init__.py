"""MLX engines, the model-preparation step, and (issue 4) the model-server actor.

Importing the package loads Debian's OpenBLAS before any MLX import (deployments/blas.py)."""

from deployments.blas import preload_openblas

preload_openblas()
