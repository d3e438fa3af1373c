# All set-up happens here: both main targets create and use the project virtual environment.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv run test test-all bench-residency clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# The main job. Until the Serve app lands (issue 4) it is the residency trace simulator.
run: $(STAMP)
	$(PY) -m bench.residency

test: $(STAMP)
	$(PY) -m pytest

test-all: $(STAMP)
	$(PY) -m pytest -m ''

bench-residency: $(STAMP)
	$(PY) -m bench.residency --markdown docs/residency-simulation.md

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
