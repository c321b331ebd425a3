# Two entry points for a fresh machine (see README):
#   make demo   -- the main job: the embedded engine called directly vs through the sidecar (demo.png)
#   make test   -- the whole test suite
# Both build their own virtual environment in .venv first.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test venv bench-theory clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,sharegpt]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/binbatch demo

bench-theory: $(STAMP)
	$(BIN)/binbatch bench theory --plot theory.png

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info

# End to end on a kind cluster (needs docker with a daemon, kind and kubectl; skipped otherwise):
# builds the image, installs the chart, applies manifests/samples/cpu-emulator.yaml.
.PHONY: e2e
e2e: $(STAMP)
	$(BIN)/python -m pytest -q -m e2e tests/e2e
