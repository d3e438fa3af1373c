"""What importing `deployments` sets for MLX before any engine runs: MLX's own attention kernels on
CUDA (a cuDNN graph per prefill shape costs an agent's every group; deployments/__init__.py), unless
the operator chose otherwise. A fresh interpreter each, as an engine's actor process is."""

import os
import subprocess
import sys

import pytest

PROBE = "import deployments, os; print(os.environ.get('MLX_CUDA_USE_CUDNN_SDPA'))"


def _probe(env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip()


def test_importing_deployments_keeps_mlx_attention_on_cuda() -> None:
    env = {k: v for k, v in os.environ.items() if k != "MLX_CUDA_USE_CUDNN_SDPA"}
    assert _probe(env) == "0"


@pytest.mark.parametrize("chosen", ["1", "0"])
def test_an_operators_choice_stands(chosen: str) -> None:
    assert _probe(os.environ | {"MLX_CUDA_USE_CUDNN_SDPA": chosen}) == chosen
