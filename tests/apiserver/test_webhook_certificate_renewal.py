"""The webhook's built-in certificate renewed while the operator runs, against a real API server.

The operator of ``helm_release`` runs as in test_operator_against_apiserver.py (the chart's command
and environment, the ServiceAccount's token, the Service played by ``ServiceProxy``), but with a
30-second certificate (``BINBATCH_WEBHOOK_CERT_SECONDS``): it renews it about 20 seconds in.  The
chart's webhook fails open (failurePolicy Ignore), so a pod the API server could not get through
to the webhook for is admitted without the sidecar: every pod made across the renewal must have it.
"""

from __future__ import annotations

import base64
import socket
import ssl
from collections.abc import Iterator
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from kube_support import Cluster, wait_for
from test_operator_against_apiserver import (  # noqa: F401 -- policy_namespace is a fixture used here
    INJECT,
    SELECTOR,
    Operator,
    containers,
    create_pod,
    create_policy,
    policy_namespace,
    reconciled,
    release_operator,
)

from binbatch_operator.builders import SIDECAR_CONTAINER

pytestmark = pytest.mark.apiserver

LIFETIME_SECONDS = 30


@pytest.fixture(scope="module")
def operator(cluster: Cluster, helm_release: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    """The operator of ``helm_release`` with a short-lived certificate (this module's ``operator``)."""

    def fresh_certificate(process: Operator) -> None:
        # the release's shared certificate Secret, if an earlier operator of this session made a year-long one
        secret = process.env["BINBATCH_WEBHOOK_CERT_SECRET"]
        cluster.kubectl("--namespace", helm_release, "delete", "secret", secret, "--ignore-not-found")

    with release_operator(cluster, helm_release, tmp_path_factory.mktemp("renewing-operator"),
                          env={"BINBATCH_WEBHOOK_CERT_SECONDS": str(LIFETIME_SECONDS)},
                          prepare=fresh_certificate) as process:  # fmt: skip
        yield process


def served_certificate(port: int) -> bytes:
    """The certificate the operator's webhook presents on 127.0.0.1 (PEM), unverified: only to see which."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock, context.wrap_socket(sock) as tls:
        der = tls.getpeercert(binary_form=True)
    return x509.load_der_x509_certificate(der).public_bytes(serialization.Encoding.PEM)


def ca_bundle(cluster: Cluster, operator: Operator) -> list[bytes]:
    config = cluster.admission.read_mutating_webhook_configuration(operator.webhook_config)
    bundle = base64.b64decode(config.webhooks[0].client_config.ca_bundle)
    return [c.public_bytes(serialization.Encoding.PEM) for c in x509.load_pem_x509_certificates(bundle)]


def test_injection_keeps_working_across_a_certificate_renewal(
    cluster: Cluster, operator: Operator, policy_namespace: Any
) -> None:
    ns = policy_namespace(INJECT)
    create_policy(cluster, ns, {"selector": SELECTOR})
    reconciled(cluster, ns, operator)
    first = served_certificate(operator.webhook_port)
    assert ca_bundle(cluster, operator) == [first]
    assert containers(create_pod(cluster, ns, "before", {"app": "vllm"})) == ["vllm", SIDECAR_CONTAINER]

    made: list[Any] = []

    def renewed() -> bytes | None:
        # A pod at every poll: each one created while the renewal happens must get the sidecar too.
        made.append(create_pod(cluster, ns, f"during-{len(made)}", {"app": "vllm"}))
        now = served_certificate(operator.webhook_port)
        return now if now != first else None

    second = wait_for("the webhook to serve a renewed certificate", renewed, timeout=3 * LIFETIME_SECONDS,
                      every=0.5, diagnose=operator.tail)  # fmt: skip
    # The new CA was published beside the old before the server switched to it.
    assert ca_bundle(cluster, operator) == [second, first]
    after = create_pod(cluster, ns, "after", {"app": "vllm"})
    missing = [p.metadata.name for p in [*made, after] if containers(p) != ["vllm", SIDECAR_CONTAINER]]
    assert missing == [], f"pods admitted without the sidecar: {missing}\n{operator.tail()}"
    assert len(made) > 2
    stored = cluster.core.read_namespaced_secret(operator.env["BINBATCH_WEBHOOK_CERT_SECRET"], operator.env["POD_NAMESPACE"])
    assert base64.b64decode(stored.data["tls.crt"]) == second  # renewed through the shared Secret
