# Two entry points for a fresh machine (see README):
#   make demo   -- the main job: the embedded engine called directly vs through the sidecar (demo.png)
#   make test   -- the whole test suite
# Both build their own virtual environment in .venv first.
#
# The release (docs/install-and-release.md; .ci/release runs these in order):
#   make image      -- docker build of the one binbatch image, tagged $(IMAGE)
#   make push       -- docker push $(IMAGE)
#   make chart      -- the Helm chart packaged by the Helm library: $(DIST)/binbatch-$(VERSION).tgz
#   make chart-push -- that archive pushed to the OCI registry $(CHART_REGISTRY)
#   make samples    -- manifests/samples with binbatch's image replaced by $(IMAGE), in $(DIST)/samples
# One version: pyproject.toml's; `IMAGE=registry.example/binbatch:dev make image push samples` overrides the image.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

VERSION        := $(shell $(PYTHON) -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
IMAGE          ?= ghcr.io/binbatch/binbatch:$(VERSION)
CHART_REGISTRY ?= oci://ghcr.io/binbatch/charts
DIST           ?= dist

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
	$(BIN)/python -m pytest -q --durations=25  # the slowest tests, so the suite's time stays visible

clean:
	rm -rf $(VENV) build *.egg-info $(DIST)

.PHONY: image push chart chart-push samples
image:
	docker build --pull --label org.opencontainers.image.version=$(VERSION) --tag $(IMAGE) .

push:
	docker push $(IMAGE)

chart: $(STAMP)
	$(BIN)/python charts/release.py package --destination $(DIST)

chart-push: chart
	$(BIN)/python charts/release.py push $(DIST)/binbatch-$(VERSION).tgz $(CHART_REGISTRY)

samples: $(STAMP)
	$(BIN)/python charts/release.py samples --image $(IMAGE) --destination $(DIST)/samples

# End to end on a kind cluster (needs docker with a daemon, kind and kubectl; skipped otherwise):
# builds the image, installs the chart, applies manifests/samples/cpu-emulator.yaml.
.PHONY: e2e
e2e: $(STAMP)
	$(BIN)/python -m pytest -q -m e2e tests/e2e
