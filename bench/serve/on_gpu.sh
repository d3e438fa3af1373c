#!/usr/bin/env bash
# The serving-path benchmark on a CUDA machine with no package index (the lent H200): install the
# carried wheels (a tar of cp312 wheels, possibly in split parts) into a private site folder, point
# mlx-cuda at the machine's own CUDA libraries, write the 10M model with the project's own tool,
# then run the given command there. Usage: bench/serve/on_gpu.sh PARTS_DIR COMMAND...
#   e.g. bench/serve/on_gpu.sh /root/wparts python3 -m bench.serve --models llama-10m --json $OUT/serve-gpu.json
# (PARTS_DIR holds wheels.tar or its parts wpart.0, wpart.1, ..., and loose wheels that override
# the tar's; see docs/serve-benchmark.md). Filter its output with `grep --line-buffered` if at all:
# a run cut off by the call's time limit otherwise loses everything still in the filter's buffer.
set -euo pipefail
parts=$1
shift
site=/tmp/orchard-site
py=python3
nvidia_dir=$($py -c 'import nvidia, os; print(os.path.realpath(nvidia.__path__[0]))')
if [ ! -f "$site/.installed" ]; then
  mkdir -p /tmp/orchard-wheels "$site"
  if [ -f "$parts/wheels.tar" ]; then tar xf "$parts/wheels.tar" -C /tmp/orchard-wheels
  else cat "$parts"/wpart.* | tar x -C /tmp/orchard-wheels; fi
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" /tmp/orchard-wheels/*.whl
  # loose wheels beside the parts replace those of the tar (a version that matches the machine's
  # own packages: grpcio-reflection must match its grpcio)
  if compgen -G "$parts/*.whl" >/dev/null; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$parts"/*.whl
  fi
  ln -sfn "$nvidia_dir" "$site/nvidia"  # libmlx.so finds CUDA through $ORIGIN/../../nvidia
  touch "$site/.installed"
fi
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1
$py - <<'EOF'
import importlib
missing = []
for name in ["ray", "ray.serve", "fastapi", "uvicorn", "pydantic", "mlx.core", "mlx_lm", "llguidance", "aiohttp", "multipart"]:
    try:
        importlib.import_module(name)
    except Exception as e:  # report every missing piece at once
        missing.append(f"{name}: {type(e).__name__}: {e}")
print("missing:", missing or "nothing")
import mlx.core as mx
print("mlx", mx.__version__, mx.default_device(), mx.device_info().get("device_name"))
EOF
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$@"
