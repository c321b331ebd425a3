"""spec.auth and the operator's Admin credential: the rendered ``auth`` section, the Secrets mounted into
the sidecar, the signing key kept in one Secret however many replicas race for it, and the signed token
on every Admin call the operator makes."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import pytest
import yaml

from binbatch_operator.admin_signing import KEY, AdminSigner, shared_signer, signing_secret
from binbatch_operator.builders import (
    ADMIN_TOKEN_PATH,
    CALLER_TOKENS_DIR,
    build_configmap,
    build_pod_patch,
    sidecar_config,
    sidecar_hash,
)
from binbatch_operator.crd import FleetSpec
from binbatch_operator.fleet_model import FleetModels
from binbatch_operator.reconcile import _spec_problems
from binbatch_operator.sidecar_stats import SidecarStats
from binbatch_sidecar.config import ConfigError, parse_config
from binbatch_sidecar.engine.admin_token import load_private_pem, new_private_pem, verify
from binbatch_sidecar.engine.record_export import Exported

IMAGE = "registry.test/binbatch:1"
SELECTOR = {"matchLabels": {"app": "vllm"}}
AUTH = {"callerTokensSecretRef": {"name": "callers"}, "adminTokenSecretRef": {"name": "dash", "key": "token"},
        "callers": [{"name": "team-a", "allowPriority": False}]}  # fmt: skip
SIGNER = AdminSigner.generate()


def test_spec_auth_renders_the_mounted_paths_the_callers_and_the_operators_key():
    cm = build_configmap("chat", "llm", {"selector": SELECTOR, "auth": AUTH}, SIGNER.public_pem)
    doc = yaml.safe_load(cm["data"]["sidecar.yaml"])
    assert doc["auth"] == {
        "callerTokensDir": CALLER_TOKENS_DIR, "adminTokenFile": ADMIN_TOKEN_PATH,
        "callers": [{"name": "team-a", "allowPriority": False}],
        "operatorPublicKeys": [SIGNER.public_pem], "audience": "llm/chat",
    }  # fmt: skip
    cfg = parse_config(doc)  # what the sidecar loads
    assert cfg.auth.callers_on and not cfg.auth.inputs_of("team-a").allows("priority")
    verify(SIGNER.token("llm/chat"), cfg.auth.operator_public_keys, cfg.auth.audience)


def test_without_spec_auth_the_config_carries_only_the_operators_key():
    doc = yaml.safe_load(build_configmap("chat", "llm", {"selector": SELECTOR}, SIGNER.public_pem)["data"]["sidecar.yaml"])
    assert doc["auth"] == {"operatorPublicKeys": [SIGNER.public_pem], "audience": "llm/chat"}
    plain = yaml.safe_load(build_configmap("chat", "llm", {"selector": SELECTOR})["data"]["sidecar.yaml"])
    assert "auth" not in plain  # no key, nothing said: the sidecars answer Admin on loopback only


@pytest.mark.parametrize(
    ("auth", "where"),
    [
        ({"callers": [{"name": "a b"}]}, "spec.auth.callers[0].name"),
        ({"callers": [{"name": "a"}, {"name": "a"}]}, "spec.auth.callers[1].name"),
        ({"callerTokensSecretRef": {}}, "spec.auth.callerTokensSecretRef.name"),
        ({"callerTokensSecretRef": {"name": "Bad_Name"}}, "spec.auth.callerTokensSecretRef.name"),
        ({"adminTokenSecretRef": {"name": "dash"}}, "spec.auth.adminTokenSecretRef.key"),
        ({"adminTokenSecretRef": {"name": "dash", "key": "t", "extra": 1}}, "spec.auth.adminTokenSecretRef.extra"),
        ({"tokens": "x"}, "spec.auth.tokens"),
    ],
)  # fmt: skip
def test_a_bad_spec_auth_is_refused_naming_the_field(auth, where):
    with pytest.raises(ConfigError) as err:
        sidecar_config({"selector": SELECTOR, "auth": auth})
    assert where in [path for path, _ in err.value.problems], err.value.problems
    assert where in [path for path, _ in _spec_problems({"selector": SELECTOR, "auth": auth})]


def test_the_pod_gets_both_secrets_mounted_read_only_and_a_new_hash():
    pod = {"metadata": {"labels": {"app": "vllm"}}, "spec": {"containers": [{"name": "vllm", "image": "v"}]}}
    spec = {"selector": SELECTOR, "auth": AUTH}
    patch = build_pod_patch(pod, "chat", 1, spec, IMAGE)
    volumes = {v["name"]: v for v in patch["spec"]["volumes"]}
    assert volumes["binbatch-caller-tokens"]["secret"] == {"secretName": "callers", "defaultMode": 0o444}
    assert volumes["binbatch-admin-token"]["secret"] == {
        "secretName": "dash", "items": [{"key": "token", "path": "admin-token"}], "defaultMode": 0o444}  # fmt: skip
    mounts = {m["name"]: m for m in patch["spec"]["containers"][1]["volumeMounts"]}
    assert mounts["binbatch-caller-tokens"] == {"name": "binbatch-caller-tokens", "mountPath": CALLER_TOKENS_DIR,
                                                "readOnly": True}  # fmt: skip
    assert mounts["binbatch-admin-token"]["mountPath"] + "/admin-token" == ADMIN_TOKEN_PATH
    assert sidecar_hash(spec, IMAGE) != sidecar_hash({"selector": SELECTOR}, IMAGE)  # mounted only in new pods
    fs_group = {**pod, "spec": {**pod["spec"], "securityContext": {"fsGroup": 2000}}}
    with_group = build_pod_patch(fs_group, "chat", 1, spec, IMAGE)
    assert {v["name"]: v for v in with_group["spec"]["volumes"]}["binbatch-caller-tokens"]["secret"]["defaultMode"] == 0o440


# -- the signing key in its Secret ---------------------------------------------------------------------------


class Store:
    """Secrets in memory; ``race``: another replica's create lands between this one's read and create."""

    def __init__(self, race: dict[str, Any] | None = None) -> None:
        self.secrets: dict[tuple[str, str], dict[str, Any]] = {}
        self.race = race
        self.creates = 0

    async def read_secret(self, name: str, namespace: str) -> dict[str, Any] | None:
        return self.secrets.get((namespace, name))

    async def create_secret(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        self.creates += 1
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        if self.race is not None:
            self.secrets[key], self.race = self.race, None
        if key in self.secrets:
            return None  # 409
        self.secrets[key] = {**obj, "metadata": {**obj["metadata"], "resourceVersion": "1"}}
        return self.secrets[key]

    async def replace_secret(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        if self.secrets[key]["metadata"]["resourceVersion"] != obj["metadata"]["resourceVersion"]:
            return None
        self.secrets[key] = {**obj, "metadata": {**obj["metadata"], "resourceVersion": "2"}}
        return self.secrets[key]


async def test_the_signing_key_is_made_once_and_loaded_after():
    store = Store()
    first = await shared_signer(store, "bb-admin-signing", "binbatch-system")
    again = await shared_signer(store, "bb-admin-signing", "binbatch-system")
    assert first.public_pem == again.public_pem and store.creates == 1
    stored = store.secrets[("binbatch-system", "bb-admin-signing")]
    assert stored["type"] == "Opaque" and list(stored["data"]) == [KEY]


async def test_two_replicas_racing_end_with_the_key_the_first_stored():
    theirs = signing_secret("bb-admin-signing", "binbatch-system", new_private_pem())
    theirs["metadata"]["resourceVersion"] = "1"
    store = Store(race=theirs)
    mine = await shared_signer(store, "bb-admin-signing", "binbatch-system")
    assert mine.public_pem == AdminSigner(load_private_pem(base64.b64decode(theirs["data"][KEY]))).public_pem
    both = await asyncio.gather(*(shared_signer(Store(), "s", "ns") for _ in range(2)))
    assert all(isinstance(s, AdminSigner) for s in both)


async def test_a_secret_without_a_usable_key_is_replaced():
    store = Store()
    broken = signing_secret("s", "ns", b"not a key")
    store.secrets[("ns", "s")] = {**broken, "metadata": {**broken["metadata"], "resourceVersion": "1"}}
    signer = await shared_signer(store, "s", "ns")
    assert store.secrets[("ns", "s")]["metadata"]["resourceVersion"] == "2"
    assert (await shared_signer(store, "s", "ns")).public_pem == signer.public_pem


# -- the token on each Admin call ----------------------------------------------------------------------------


async def test_get_stats_and_the_fleets_export_carry_a_token_signed_for_the_policy():
    seen: list[tuple[str, dict[str, Any]]] = []

    async def fetch(address: str, **kwargs: Any):
        seen.append((address, kwargs))
        return object()

    stats = SidecarStats(fetch, signer=SIGNER.token)
    await stats.ask({"llm/pod-1": "10.0.0.5:50051"}, 0, audience="llm/chat")
    [(address, kwargs)] = seen
    verify(kwargs["token"], [SIGNER.public_pem], "llm/chat")
    await SidecarStats(fetch).ask({"llm/pod-2": "10.0.0.6:50051"}, 0, audience="llm/chat")
    assert seen[-1][1] == {}  # no signer: no token (a test's fake, or loopback)

    async def export(address: str, **kwargs: Any) -> Exported:
        seen.append((address, kwargs))
        return Exported()

    fleet = FleetModels(export=export, signer=SIGNER.token, seed=1)
    settings = FleetSpec(enabled=True)
    state = fleet._state("llm", "chat", settings)
    assert await fleet.gather(state, settings, {"llm/pod-1": "10.0.0.5:50051"}, "llm/chat") == []
    verify(seen[-1][1]["token"](), [SIGNER.public_pem], "llm/chat")  # a fresh token per page
