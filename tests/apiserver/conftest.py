"""The tests against a real Kubernetes API server: ``pytest -m apiserver``.

They run when ``BINBATCH_APISERVER_KUBECONFIG`` names the admin kubeconfig of a real
API server, and are skipped, saying how to run them, otherwise (CI has none).  The
server needs no scheduler and no kubelet: pods stay Pending, so what the webhook did
is checked on the pod objects the API server stored.  docs/development.md says how to
build and start one on this machine.

What the tests leave on that server: the two CRDs, applied server-side (every policy
needs them, and deleting a CRD deletes its objects).  Everything else is made in
namespaces named ``bbt-<random>``, or is cluster-scoped and named after one, and is
deleted at the end; so are the plain install's objects.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kube_support import Cluster, run, temporary_namespace

CHART = Path(__file__).resolve().parents[2] / "charts" / "binbatch"
KUBECONFIG_ENV = "BINBATCH_APISERVER_KUBECONFIG"
SKIP_REASON = (
    f"no real API server: {KUBECONFIG_ENV} is unset. To run these, start one "
    "(../shared/tools/kube-apiserver: build.sh once, then start.sh, which prints its kubeconfig), "
    f"then {KUBECONFIG_ENV}=<that kubeconfig> pytest -m apiserver (docs/development.md)"
)
DIAGNOSE = (
    ("get", "namespaces", "--show-labels"),
    ("get", "batchingpolicies,configmaps,services,pods", "--all-namespaces", "-o", "wide"),
    ("get", "events", "--all-namespaces", "--sort-by=.lastTimestamp"),
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get(KUBECONFIG_ENV):
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if item.get_closest_marker("apiserver"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    """The API server ``BINBATCH_APISERVER_KUBECONFIG`` names, once it answers ready."""
    kubeconfig = Path(os.environ[KUBECONFIG_ENV])
    run("kubectl", "--kubeconfig", str(kubeconfig), "get", "--raw", "/readyz", timeout=30)
    return Cluster(kubeconfig, DIAGNOSE)


@pytest.fixture(scope="session")
def crds(cluster: Cluster) -> None:
    """The chart's CRDs (BatchingPolicy, and kopf's ClusterKopfPeering and KopfPeering), applied server-side and Established."""
    cluster.apply(CHART / "crds", "--force-conflicts")
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                    "crd/batchingpolicies.binbatch.io", "crd/clusterkopfpeerings.kopf.dev",
                    "crd/kopfpeerings.kopf.dev")  # fmt: skip


@pytest.fixture
def namespace(cluster: Cluster, crds: None) -> Iterator[Callable[..., str]]:
    """Makes fresh namespaces for one test: ``namespace()``, ``namespace({"label": "value"})``."""
    with contextlib.ExitStack() as stack:
        yield lambda labels=None: stack.enter_context(temporary_namespace(cluster, labels))


@pytest.fixture(scope="session")
def helm_release(cluster: Cluster, crds: None) -> Iterator[str]:
    """The chart installed by the Helm library (``helm install``, default values) in a namespace of its
    own under the restricted Pod Security Standard, as the quickstart installs it.  The release is named
    after its namespace; this returns that name."""
    import helm_python as helm

    with temporary_namespace(cluster, {"pod-security.kubernetes.io/enforce": "restricted"}) as namespace, \
            helm.Config(kubeconfig_path=cluster.kubeconfig, namespace=namespace) as config, \
            helm.Chart.load(CHART) as chart:  # fmt: skip
        try:
            config.install(chart, namespace, namespace=namespace, timeout=120)
        except helm.HelmError as exc:
            pytest.fail(f"helm install failed: {exc}\n{cluster.diagnostics()}")
        try:
            yield namespace
        finally:
            config.uninstall(namespace, timeout=120)
