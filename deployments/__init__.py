"""MLX engines, the model-preparation step, and (issue 4) the model-server actor.

Importing the package loads Debian's OpenBLAS before any MLX import (deployments/blas.py), and keeps
MLX's own attention kernels on CUDA: MLX sends a prefill's attention to cuDNN there and builds a
cuDNN graph for every new shape (mlx/backend/cuda/scaled_dot_product_attention.cpp), and a serving
engine's prefills almost never repeat a shape (a group's rows, new and cached tokens). On the H200,
`bench.engine.sdpa_shapes`: 68 ms (p50, up to 1.2 s) for a new shape against 0.25 ms for a repeated
one, 2.2 ms with MLX's kernels; the agent workload in process gained 749 -> 894 tok/s
(docs/peers-benchmark.md). No effect on a Mac or a CPU; an operator may set the variable to 1."""

import os

from deployments.blas import preload_openblas

preload_openblas()
os.environ.setdefault("MLX_CUDA_USE_CUDNN_SDPA", "0")
