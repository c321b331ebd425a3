"""Policies on a real API server: the same ``CASES`` the offline harness judges
(``tests/crd_admission.py``, run by ``tests/unit/test_crd_cel.py``), and the samples.

Each case is created as a server-side dry run (admission, defaulting, the schema and
every CEL rule; nothing is stored), with kubectl's strict field validation.  The real
server and the offline harness must agree: both accept, storing the same defaulted
spec, or both refuse, naming the same field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from crd_admission import CASES, SAMPLES, admission, policy_spec
from kube_support import Cluster, temporary_namespace

from binbatch_operator import crd

pytestmark = pytest.mark.apiserver


@pytest.fixture(scope="module")
def policy_namespace(cluster: Cluster, crds: None) -> Iterator[str]:
    with temporary_namespace(cluster) as name:
        yield name


def dry_run_create(cluster: Cluster, namespace: str, spec: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """(the object the server would store, "") if it accepts ``spec``, else (None, its message)."""
    from kubernetes.client.exceptions import ApiException

    body = {"apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND, "metadata": {"name": "case"}, "spec": spec}
    try:
        stored = cluster.custom.create_namespaced_custom_object(
            crd.GROUP, crd.VERSION, namespace, crd.PLURAL, body, dry_run="All", field_validation="Strict")
    except ApiException as exc:
        if exc.status not in (400, 422):
            raise
        return None, json.loads(exc.body)["message"]
    return stored, ""


def names_field(message: str, field: str) -> bool:
    """The server's message names ``field``: ``field: ...``, ``field[1]: ...`` or ``unknown field "field"``."""
    return re.search(re.escape(field) + r'(?=[:\["])', message) is not None


@pytest.mark.parametrize("case", list(CASES))
def test_the_real_server_and_the_offline_harness_agree(cluster: Cluster, policy_namespace: str, case: str) -> None:
    overrides, field = CASES[case]
    spec = policy_spec(overrides)
    offline_stored, found = admission(spec)
    stored, message = dry_run_create(cluster, policy_namespace, spec)
    if field is None:
        assert stored is not None, message
        assert found == []
        assert stored["spec"] == offline_stored  # the server's defaults are the harness's
    else:
        assert stored is None, f"the server accepted what the harness refuses naming {field}: {found}"
        assert names_field(message, field), message
        assert {f.path for f in found} == {field}


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
def test_the_samples_apply_as_a_server_side_dry_run(cluster: Cluster, policy_namespace: str, sample: Path) -> None:
    out = cluster.apply(sample, "--namespace", policy_namespace, "--dry-run=server")
    assert re.search(r"batchingpolic(y|ies)\.binbatch\.io/\S+ serverside-applied \(server dry run\)", out), out
