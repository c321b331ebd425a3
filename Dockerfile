# One image, two programs: the binbatch CLI (`binbatch sidecar`, `binbatch emulate-engine`,
# `binbatch demo`, `binbatch bench`) and the operator (`kopf run -m binbatch_operator.main`).
# No ENTRYPOINT, so a Pod's `command` picks the program; the default just prints help.
#
#   make image    # docker build, tagged ghcr.io/binbatch/binbatch:<pyproject.toml's version>;
#                 # IMAGE=registry.example/binbatch:dev make image push  for another name
#
# Without BINBATCH_SIDECAR_IMAGE the operator injects ghcr.io/binbatch/binbatch:<its installed
# version>; the chart always sets it, to its own image.repository:image.tag.

FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY sidecar ./sidecar
COPY operator ./operator
# A wheel of the project only; its runtime dependencies are installed in the final stage.
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp \
    MPLCONFIGDIR=/tmp/matplotlib
# The runtime dependencies only (pyproject's [project] dependencies, not the test extra).
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
# Run from a folder without a source tree: a folder named `operator` in the working
# directory would shadow the standard library's `operator` module.
WORKDIR /tmp
# Non-root; the charts and the injected sidecar run with readOnlyRootFilesystem and an
# emptyDir at /tmp where something must be written.
USER 10001:10001
CMD ["binbatch", "--help"]
