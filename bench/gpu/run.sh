#!/usr/bin/env bash
# Everything a benchmark needs on the lent CUDA machine (an H100 or H200, no package index there,
# a device call carries at most 64 MiB and runs at most 10 minutes, a machine idle for 30 s is given
# back and the next call starts a bare one): carry the wheels over in parts, install them into a
# private site folder, prepare the model, run a command, or start a long one and wait for it over
# several calls. Every step runs on the device machine, from the repository's root.
#
# Here, once (writes .gpu/wpart.N, .gpu/peers/; --engine-only: just what bench.engine.* needs):
#   python -m bench.gpu.wheels --part-mib 50
# There, in back-to-back device calls (each `carry` call carries its part: the device tool's `carry`
# argument names .gpu/wpart.N, and the call that installs also carries .gpu/peers):
#   bench/gpu/run.sh carry 0            # then carry 1, carry 2, ...: parts gather in $PARTS
#   bench/gpu/run.sh install llama-1b-shape   # wheels, vllm-mlx's site folder, the models named
#   bench/gpu/run.sh run python3 -m bench.peers --agent --models-dir /root/models --model llama-1b-shape \
#       --concurrency 16 --system-tokens 3000 --interleave --warmup --vllm-mlx-site /root/vllm-site \
#       --json $OUT/peers-agent-gpu.json
# A run longer than one call: `start NAME COMMAND...` runs it detached (from a copy of the committed
# tree, so a later call's working tree does not change what runs), `wait NAME [SECONDS]` in the next
# calls brings back its log and what it wrote under $RESULTS:
#   bench/gpu/run.sh start swap python3 -m bench.swap --model llama-1b-shape --models-dir /root/models \
#       --servers orchard,vllm-mlx --vllm-mlx-site /root/vllm-site --json /root/res/swap-gpu.json
#   bench/gpu/run.sh wait swap 560
# Filter a command's output with `grep --line-buffered` if at all: a run cut off by the call's time
# limit otherwise loses everything still in the filter's buffer. docs/performance.md lists the
# commands behind every GPU figure.
set -euo pipefail
PARTS=${PARTS:-/root/wparts}        # the wheel parts, gathered over calls
SITE=${SITE:-/tmp/orchard-site}     # the carried packages, installed
PEERS_SITE=${PEERS_SITE:-/root/vllm-site}  # vllm-mlx 0.6.0 and its mlx-lm 0.31.3 (bench.peers --vllm-mlx-site)
MODELS=${MODELS:-/root/models}      # models made by `python3 -m deployments.models prepare`
RESULTS=${RESULTS:-/root/res}       # what detached runs write
PY=${PY:-python3}                   # the machine's own Python 3.12 (its CUDA libraries come with its PyTorch)
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WHEELS=${WHEELS:-$ROOT/.gpu}         # what bench.gpu.wheels wrote here (its --out), carried

usage() { sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

environment() {
  export PYTHONPATH="$SITE:${REPO:-$ROOT}" PYTHONUNBUFFERED=1
  # one kernel cache for every process (Orchard's own, <store>/.kernels), so no server starts colder
  export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-$MODELS/.kernels}
}

carry() {
  mkdir -p "$PARTS"
  for n in "$@"; do cp "$WHEELS/wpart.$n" "$PARTS/"; done
  if [ -d "$WHEELS/peers" ]; then mkdir -p "$PARTS/peers" && cp "$WHEELS"/peers/*.whl "$PARTS/peers/"; fi
  ls -la "$PARTS"
}

install() {
  local nvidia_dir
  nvidia_dir=$($PY -c 'import nvidia, os; print(os.path.realpath(nvidia.__path__[0]))')
  if [ ! -f "$SITE/.installed" ]; then
    mkdir -p /tmp/orchard-wheels "$SITE"
    if [ -f "$PARTS/wheels.tar" ]; then tar xf "$PARTS/wheels.tar" -C /tmp/orchard-wheels
    else cat "$PARTS"/wpart.* | tar x -C /tmp/orchard-wheels; fi
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" /tmp/orchard-wheels/*.whl
    # loose wheels beside the parts replace those of the tar (grpcio-reflection must match the image's grpcio)
    if compgen -G "$PARTS/*.whl" >/dev/null; then
      $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$PARTS"/*.whl
    fi
    ln -sfn "$nvidia_dir" "$SITE/nvidia"  # libmlx.so finds CUDA through $ORIGIN/../../nvidia
    touch "$SITE/.installed"
  fi
  if compgen -G "$PARTS/peers/*.whl" >/dev/null && [ ! -d "$PEERS_SITE" ]; then
    $PY -m pip install -q --no-index --no-deps --target "$PEERS_SITE" "$PARTS"/peers/*.whl
  fi
  environment
  $PY - <<'PYEOF'
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
PYEOF
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  for model in "$@"; do (cd "$ROOT" && $PY -m deployments.models prepare "$MODELS" --only "$model"); done
}

start() {
  local name=$1
  shift
  mkdir -p "$RESULTS"
  rm -rf "$RESULTS/repo-$name" && mkdir -p "$RESULTS/repo-$name"
  (cd "$ROOT" && git archive HEAD 2>/dev/null || tar cf - --exclude=.gpu --exclude=.git .) | tar x -C "$RESULTS/repo-$name"
  rm -f "$RESULTS/$name.rc"
  REPO="$RESULTS/repo-$name" environment
  (cd "$RESULTS/repo-$name" && setsid nohup bash -c '"$@"; echo $? > "'"$RESULTS/$name.rc"'"' _ "$@" \
    >"$RESULTS/$name.log" 2>&1 </dev/null &)
  sleep 20
  tail -c 4000 "$RESULTS/$name.log"
}

wait_for() {
  local name=$1 end=$((SECONDS + ${2:-560}))
  while [ ! -f "$RESULTS/$name.rc" ] && [ $SECONDS -lt $end ]; do sleep 3; done
  grep -v 'WARNING\|INFO' "$RESULTS/$name.log" | tail -c 10000 || true
  find "$RESULTS" -maxdepth 1 -type f -exec cp {} "${OUT:-.}/" \;
  echo "$name rc: $(cat "$RESULTS/$name.rc" 2>/dev/null || echo still running)"
}

case "${1:-help}" in
  carry) shift; carry "$@" ;;
  install) shift; install "$@" ;;
  run) shift; [ -f "$SITE/.installed" ] || { echo "nothing installed: bench/gpu/run.sh install first" >&2; exit 2; }
       environment; cd "$ROOT"; "$@" ;;
  start) shift; [ $# -ge 2 ] || usage 2; start "$@" ;;
  wait) shift; [ $# -ge 1 ] || usage 2; wait_for "$@" ;;
  help|-h|--help) usage ;;
  *) usage 2 ;;
esac
