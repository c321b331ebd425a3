"""The port take-over: the webhook's patch for each way a pod can give vLLM its port, and every refusal."""

from __future__ import annotations

import copy
import logging
from typing import Any

import kubernetes_validate
import pytest
import yaml

from binbatch_operator import builders, takeover
from binbatch_operator.reconcile import Context, admit, reconcile
from binbatch_sidecar.config import parse_config

IMAGE = "registry.example/binbatch:test"
SPEC: dict[str, Any] = {
    "selector": {"matchLabels": {"app": "vllm"}},
    "sidecar": {"grpcPort": 50051, "httpPort": 8080, "metricsPort": 9090, "takeOverServingPort": {"enabled": True}},
}
ENGINE = 8001  # the default enginePort


def pod(*containers: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"generateName": "vllm-", "namespace": "llm", "labels": {"app": "vllm"}},
        "spec": {"containers": list(containers), **spec},
    }  # fmt: skip


def vllm(**fields: Any) -> dict[str, Any]:
    return {"name": "vllm", "image": "vllm/vllm-openai:v0.11.0", **fields}


def injected(p: dict[str, Any], spec: dict[str, Any] = SPEC) -> tuple[dict[str, Any], dict[str, Any]]:
    """The vLLM container and the sidecar as the patched pod has them."""
    patch = builders.build_pod_patch(p, "fast", 1, spec, IMAGE)
    containers = {c["name"]: c for c in patch["spec"]["containers"]}
    return containers["vllm"], containers[builders.SIDECAR_CONTAINER]


def refusal(p: dict[str, Any], spec: dict[str, Any] = SPEC) -> takeover.TakeOverRefused:
    with pytest.raises(takeover.TakeOverRefused) as caught:
        builders.build_pod_patch(p, "fast", 1, spec, IMAGE)
    return caught.value


def ports(container: dict[str, Any]) -> dict[str, int]:
    return {p.get("name", ""): p["containerPort"] for p in container.get("ports") or []}


# -- each form of the port argument ------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "serving", "expected"),
    [
        ({"args": ["--model", "m", "--port", "8000"]}, 8000,
         {"args": ["--model", "m", "--port", "8001", "--host", "127.0.0.1"]}),
        ({"args": ["--model", "m", "--port=9000"]}, 9000,
         {"args": ["--model", "m", "--port=8001", "--host", "127.0.0.1"]}),
        ({"command": ["vllm", "serve", "m", "--port", "7000"]}, 7000,
         {"command": ["vllm", "serve", "m", "--port", "8001", "--host", "127.0.0.1"]}),
        ({"command": ["vllm", "serve", "m", "--port", "7000"], "args": ["--dtype", "half"]}, 7000,
         {"command": ["vllm", "serve", "m", "--port", "8001"], "args": ["--dtype", "half", "--host", "127.0.0.1"]}),
        ({"args": ["--model", "m"]}, 8000,
         {"args": ["--model", "m", "--host", "127.0.0.1", "--port", "8001"]}),
        ({"command": ["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"]}, 8000,
         {"command": ["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "m",
                      "--host", "127.0.0.1", "--port", "8001"]}),
        ({"args": ["--host", "0.0.0.0", "--port", "8000", "--model", "m"]}, 8000,
         {"args": ["--host", "127.0.0.1", "--port", "8001", "--model", "m"]}),
        ({"args": ["--host=::", "--port=8000"]}, 8000, {"args": ["--host=127.0.0.1", "--port=8001"]}),
        ({"args": ["--port", "8000", "--port", "8100"]}, 8100,  # argparse: the last one wins
         {"args": ["--port", "8001", "--port", "8001", "--host", "127.0.0.1"]}),
        ({"args": ["--port", "$(SERVE_PORT)"], "env": [{"name": "SERVE_PORT", "value": "8500"}]}, 8500,
         {"args": ["--port", "8001", "--host", "127.0.0.1"]}),
        ({"args": ["--config", "/etc/vllm.yaml", "--port", "8000"]}, 8000,  # the command line beats the file
         {"args": ["--config", "/etc/vllm.yaml", "--port", "8001", "--host", "127.0.0.1"]}),
    ],
    ids=["--port N in args", "--port=N", "--port N in command", "--port in command, args beside",
         "absent, args", "absent, command only", "--host replaced", "--host= and --port=", "--port twice",
         "$(VAR) of a literal env", "--config with --port"],
)  # fmt: skip
def test_vllm_moves_to_the_engine_port_on_loopback_and_the_sidecar_takes_its_port(fields, serving, expected):
    engine, side = injected(pod(vllm(**fields)))
    for key in ("command", "args"):
        assert engine.get(key) == expected.get(key), key
    assert side["command"][-2:] == ["--take-over-port", str(serving)]
    assert ports(side) == {"bb-grpc": 50051, "bb-http": 8080, "bb-metrics": 9090, "": serving}  # declared once, bare
    assert "ports" not in engine


def test_the_rest_of_the_pod_is_kept_and_the_patched_pod_is_a_valid_pod():
    p = pod(vllm(args=["--model", "m"], resources={"limits": {"nvidia.com/gpu": "1"}}),
            {"name": "log-shipper", "image": "fluent-bit", "ports": [{"containerPort": 2020}]})  # fmt: skip
    before = copy.deepcopy(p)
    patch = builders.build_pod_patch(p, "fast", 1, SPEC, IMAGE)
    assert p == before  # the pod handed in is not modified
    names = [c["name"] for c in patch["spec"]["containers"]]
    assert names == ["vllm", "log-shipper", builders.SIDECAR_CONTAINER]
    assert patch["spec"]["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": "1"}}
    assert patch["spec"]["containers"][1] == p["spec"]["containers"][1]
    whole = {**p, "metadata": {**p["metadata"], **patch["metadata"]}, "spec": {**p["spec"], **patch["spec"]}}
    whole["spec"]["volumes"] = [v for v in whole["spec"]["volumes"]]
    kubernetes_validate.validate(whole, "1.30", strict=True)


def test_named_serving_port_moves_to_the_sidecar_and_probes_that_named_it_get_its_number():
    """kubelet resolves a named probe port in the probe's own container: after the move it would not resolve."""
    container = vllm(
        args=["--port", "8000"],
        ports=[{"name": "http", "containerPort": 8000, "protocol": "TCP"}, {"name": "dist", "containerPort": 29500}],
        readinessProbe={"httpGet": {"path": "/health", "port": "http"}},
        livenessProbe={"httpGet": {"path": "/health", "port": 8000}},
        startupProbe={"tcpSocket": {"port": "http"}, "failureThreshold": 120},
        lifecycle={"preStop": {"httpGet": {"path": "/drain", "port": "http"}}},
    )
    engine, side = injected(pod(container))
    assert ports(engine) == {"dist": 29500}  # other ports stay with vLLM
    assert ports(side) == {"bb-grpc": 50051, "bb-http": 8080, "bb-metrics": 9090, "http": 8000}
    assert engine["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    assert engine["livenessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    assert engine["startupProbe"]["tcpSocket"] == {"port": 8000}
    assert engine["lifecycle"]["preStop"]["httpGet"]["port"] == 8000


def test_a_bare_serving_port_entry_moves_as_one_bare_entry_and_a_host_port_is_kept():
    bare = vllm(args=["--port", "8000"], ports=[{"containerPort": 8000}, {"containerPort": 8000, "protocol": "UDP"}])
    engine, side = injected(pod(bare))
    assert engine["ports"] == [{"containerPort": 8000, "protocol": "UDP"}]  # not HTTP: left alone
    assert ports(side) == {"bb-grpc": 50051, "bb-http": 8080, "bb-metrics": 9090, "": 8000}
    hosted = vllm(args=["--port", "8000"], ports=[{"containerPort": 8000, "hostPort": 80}])
    _, side = injected(pod(hosted))
    assert [p for p in side["ports"] if p["containerPort"] == 8000] == [{"containerPort": 8000, "hostPort": 80}]


def api_port_warnings(pod_spec: dict[str, Any]) -> list[str]:
    """The API server's warnings about a pod's ports, as Kubernetes 1.36 words them
    (``pkg/api/pod/warnings.go``): across init, regular and ephemeral containers, one
    (containerPort, protocol) declared twice, and one port name used twice."""
    warnings: list[str] = []
    seen: dict[tuple[int, str], list[tuple[str, dict[str, Any]]]] = {}
    named: dict[str, str] = {}
    for group in ("initContainers", "containers", "ephemeralContainers"):
        for i, c in enumerate(pod_spec.get(group) or []):
            for j, port in enumerate(c.get("ports") or []):
                here = f"spec.{group}[{i}].ports[{j}]"
                host_ip, host_port = port.get("hostIP", ""), port.get("hostPort", 0)
                for where, other in seen.setdefault((port["containerPort"], port.get("protocol") or "TCP"), []):
                    if (host_ip, host_port) == (other.get("hostIP", ""), other.get("hostPort", 0)):
                        warnings.append(f"{here}: duplicate port definition with {where}")
                    elif not host_port or not other.get("hostPort", 0):
                        warnings.append(f"{here}: overlapping port definition with {where}")
                    elif host_port == other.get("hostPort") and (host_ip == "") != (other.get("hostIP", "") == ""):
                        warnings.append(f"{here}: dangerously ambiguous port definition with {where}")
                seen[(port["containerPort"], port.get("protocol") or "TCP")].append((here, port))
                name = port.get("name")
                if name and name in named:
                    warnings.append(f'{here}: duplicate port name "{name}" with {named[name]}, services and probes '
                                    f"that select ports by name will use {named[name]}")
                elif name:
                    named[name] = here
    return warnings


def test_the_port_warning_mirror_words_what_the_api_server_said_about_the_old_take_over():
    """Before: the sidecar declared the serving port as bb-http and again under vLLM's name."""
    old = {"name": "binbatch-sidecar", "image": IMAGE, "ports": [
        {"name": "bb-grpc", "containerPort": 50051}, {"name": "bb-http", "containerPort": 8000},
        {"name": "bb-metrics", "containerPort": 9090}, {"name": "http", "containerPort": 8000, "protocol": "TCP"}]}
    spec = {"containers": [vllm(args=["--port", "8001"]), old]}
    assert api_port_warnings(spec) == ["spec.containers[1].ports[3]: duplicate port definition with spec.containers[1].ports[1]"]
    native = {"initContainers": [{**old, "restartPolicy": "Always"}], "containers": [vllm(args=["--port", "8001"])]}
    assert api_port_warnings(native) == ["spec.initContainers[0].ports[3]: duplicate port definition with spec.initContainers[0].ports[1]"]


@pytest.mark.parametrize("native", [False, True], ids=["classic", "native"])
@pytest.mark.parametrize(
    "container",
    [
        vllm(args=["--port", "8000"], ports=[{"name": "http", "containerPort": 8000, "protocol": "TCP"}]),
        vllm(args=["--port", "8000"], ports=[{"containerPort": 8000}]),
        vllm(args=["--model", "m"]),
        vllm(args=["--port", "8000"], ports=[{"name": "http", "containerPort": 8000, "hostPort": 18000}]),
        vllm(args=["--port", "8000"], ports=[{"name": "http", "containerPort": 8000}, {"name": "metrics", "containerPort": 9000}]),
    ],
    ids=["named serving port", "bare serving port", "no ports", "host port", "another port"],
)  # fmt: skip
def test_the_taken_over_pod_declares_every_port_once(container, native):
    p = pod(container)
    patch = builders.build_pod_patch(p, "fast", 1, SPEC, IMAGE)
    if native:
        patch = builders.as_native_sidecar(patch, p)
    assert api_port_warnings(patch["spec"]) == []
    declared = [port["containerPort"] for c in [*patch["spec"]["containers"], *patch["spec"].get("initContainers", [])]
                for port in c.get("ports") or []]  # fmt: skip
    assert declared.count(8000) == 1 and declared.count(8080) == 1


def test_the_config_points_the_sidecar_at_the_engine_port():
    spec = {**SPEC, "engine": {"url": "http://localhost:8000/"}}
    cfg = parse_config(yaml.safe_load(builders.build_configmap("fast", "llm", spec)["data"][builders.CONFIG_KEY]))
    assert cfg.engine.url == f"http://localhost:{ENGINE}/"
    assert cfg.metrics.url == f"http://127.0.0.1:{ENGINE}/metrics"
    promql = {**SPEC, "metrics": {"source": "PromQL", "url": "http://prometheus.monitoring:9090"}}
    cfg = parse_config(yaml.safe_load(builders.build_configmap("fast", "llm", promql)["data"][builders.CONFIG_KEY]))
    assert cfg.metrics.url == "http://prometheus.monitoring:9090" and cfg.engine.url == f"http://127.0.0.1:{ENGINE}"
    off = {**SPEC, "sidecar": {"takeOverServingPort": {"enabled": False}}}
    cfg = parse_config(yaml.safe_load(builders.build_configmap("fast", "llm", off)["data"][builders.CONFIG_KEY]))
    assert cfg.engine.url == "http://127.0.0.1:8000"


def test_the_vllm_container_is_found_by_name_or_by_naming_vllm():
    helper = {"name": "proxy", "image": "envoy", "args": ["--port", "9901"]}
    engine, _ = injected(pod(helper, vllm(args=["--model", "m"])))
    assert engine["args"][-4:] == ["--host", "127.0.0.1", "--port", "8001"]
    spec = copy.deepcopy(SPEC)
    spec["sidecar"]["takeOverServingPort"]["container"] = "server"
    named = {"name": "server", "image": "registry.example/llm:1", "args": ["--port", "8000"]}
    patch = builders.build_pod_patch(pod(helper, named), "fast", 1, spec, IMAGE)
    assert patch["spec"]["containers"][0] == helper and patch["spec"]["containers"][1]["args"][1] == "8001"


def test_sidecar_hash_tells_pods_injected_before_the_take_over_was_turned_on():
    off = {**SPEC, "sidecar": {**SPEC["sidecar"], "takeOverServingPort": {"enabled": False}}}
    assert builders.sidecar_hash(off, IMAGE) != builders.sidecar_hash(SPEC, IMAGE)
    other = copy.deepcopy(SPEC)
    other["sidecar"]["takeOverServingPort"]["enginePort"] = 18000
    assert builders.sidecar_hash(other, IMAGE) != builders.sidecar_hash(SPEC, IMAGE)


def test_a_native_sidecar_keeps_the_rewritten_vllm_container():
    p = pod(vllm(args=["--port", "8000"]))
    patch = builders.as_native_sidecar(builders.build_pod_patch(p, "fast", 1, SPEC, IMAGE), p)
    assert patch["spec"]["containers"][0]["args"] == ["--port", "8001", "--host", "127.0.0.1"]
    assert patch["spec"]["initContainers"][0]["command"][-2:] == ["--take-over-port", "8000"]


# -- what cannot be rewritten safely is refused, naming the field ------------------------------


@pytest.mark.parametrize(
    ("p", "field", "says"),
    [
        (pod(vllm()), "spec.containers[0].args", "come from the image"),
        (pod(vllm(command=["/bin/sh", "-c", "vllm serve m --port 8000"])), "spec.containers[0].command", "shell"),
        (pod(vllm(args=["--model", "m", "--port", "$(PORT)"], env=[{"name": "PORT", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}])),
         "spec.containers[0].args[3]", "valueFrom"),
        (pod(vllm(args=["--port", "$(PORT)"])), "spec.containers[0].args[1]", "does not define"),
        (pod(vllm(args=["--port", "http"])), "spec.containers[0].args[1]", "not a port number"),
        (pod(vllm(args=["--model", "m", "--port"])), "spec.containers[0].args[2]", "no value"),
        (pod(vllm(args=["--model m --port 8000"])), "spec.containers[0].args[0]", "longer argument"),
        (pod(vllm(args=["--config", "/etc/vllm.yaml"])), "spec.containers[0].args", "--config"),
        (pod(vllm(args=["--port", "8000", "--ssl-keyfile", "/tls/key"])), "spec.containers[0].args[2]", "TLS"),
        (pod(vllm(args=["--uds=/run/vllm.sock"])), "spec.containers[0].args[0]", "unix socket"),
        (pod(vllm(args=["--port", "8001"])), "spec.sidecar.takeOverServingPort.enginePort", "serving port 8001"),
        (pod(vllm(args=["--port", "9090"])), "spec.sidecar.metricsPort", "serving port 9090"),
        (pod(vllm(args=["--port", "8080"])), "spec.sidecar.httpPort", "serving port 8080"),
        (pod(vllm(args=["--port", "80"])), "spec.containers[0].args", "privileged"),
        (pod(vllm(args=["--port", "8000"]), {"name": "exporter", "image": "e", "ports": [{"containerPort": 8001}]}),
         "spec.containers[1].ports[0]", "enginePort"),
        (pod(vllm(args=["--port", "8000"]), initContainers=[{"name": "dl", "image": "d", "ports": [{"containerPort": 8000}]}]),
         "spec.initContainers[0].ports[0]", "serving port"),
        (pod(vllm(args=["--port", "8000"], ports=[{"name": "bb-http", "containerPort": 8000}])),
         "spec.containers[0].ports", "bb-http"),
        (pod({"name": "a", "image": "x"}, {"name": "b", "image": "y"}), "spec.containers", "set spec.sidecar.takeOverServingPort.container"),
        (pod(vllm(args=["--port", "8000"]), {"name": "vllm-router", "image": "vllm/router"}), "spec.containers", "vllm, vllm-router"),
    ],
    ids=["no command or args", "shell", "env valueFrom", "env undefined", "not a number", "no value", "one long argument",
         "--config without --port", "TLS", "unix socket", "serving port is enginePort", "serving port is metricsPort", "serving port is httpPort", "privileged port",
         "engine port declared elsewhere", "serving port declared by an init container", "port named like ours",
         "which container", "two containers name vllm"],
)  # fmt: skip
def test_a_pod_that_cannot_be_rewritten_safely_is_refused_naming_the_field(p, field, says):
    refused = refusal(p)
    assert refused.field == field and says in refused.message, str(refused)


def test_a_privileged_serving_port_is_taken_over_where_the_pod_lets_non_root_bind_it():
    p = pod(vllm(args=["--port", "80"]), securityContext={"sysctls": [{"name": "net.ipv4.ip_unprivileged_port_start", "value": "0"}]})
    _, side = injected(p)
    assert ports(side)[""] == 80 and side["command"][-2:] == ["--take-over-port", "80"]


def test_a_named_container_that_is_missing_is_refused():
    spec = copy.deepcopy(SPEC)
    spec["sidecar"]["takeOverServingPort"]["container"] = "engine"
    refused = refusal(pod(vllm(args=["--port", "8000"])), spec)
    assert refused.field == "spec.containers" and "takeOverServingPort.container" in refused.message


def test_a_refused_pod_is_admitted_untouched_with_an_annotation_and_a_warning():
    p = pod(vllm(command=["bash", "-c", "exec vllm serve m"]))
    patch, warnings = admit(p, [{"name": "fast", "spec": SPEC, "generation": 2}], IMAGE)
    assert set(patch) == {"metadata"} and set(patch["metadata"]) == {"annotations"}  # never half-patched
    note = patch["metadata"]["annotations"][builders.REFUSED_ANNOTATION]
    assert note.startswith("spec.containers[0].command: vLLM is started through a shell")
    assert len(warnings) == 1 and "cannot take over" in warnings[0] and "spec.containers[0].command" in warnings[0]


class Kube:
    def __init__(self, pods):
        self.pods, self.children = pods, {}

    async def ensure(self, obj):
        self.children[(obj["kind"], obj["metadata"]["name"])] = obj
        return "created"

    reads = 0

    async def read(self, kind, name, namespace):
        self.reads += 1
        return self.children.get((kind, name))

    async def delete(self, kind, name, namespace):
        return self.children.pop((kind, name), None) is not None

    async def list_pods(self, namespace, match_labels):
        return self.pods


async def test_the_policy_status_names_refused_pods_and_warns_once(caplog):
    running = pod(vllm(args=["--port", "$(P)"]))
    running["metadata"] |= {"name": "vllm-0"}
    body = {"metadata": {"name": "fast", "namespace": "llm", "uid": "u", "generation": 1}, "spec": SPEC, "status": {}}
    ctx, log = Context(kube=Kube([running]), sidecar_image=IMAGE), logging.getLogger("takeover-test")
    with caplog.at_level(logging.WARNING, logger="takeover-test"):
        first = (await reconcile(ctx, body, [], log)).status
        await reconcile(ctx, {**body, "status": first}, [], log)
    sidecars = next(c for c in first["conditions"] if c["type"] == "SidecarsInjected")
    assert (sidecars["status"], sidecars["reason"]) == ("False", "TakeOverRefused")
    assert "vllm-0: spec.containers[0].args[1]: --port is $(P)" in sidecars["message"]
    assert len(caplog.records) == 1 and "vllm-0" in caplog.records[0].getMessage()  # one Event per change


# -- the headless Service --------------------------------------------------------------------


async def test_headless_service_follows_spec_service_headless():
    spec = {**SPEC, "service": {"headless": True}}
    body = {"apiVersion": "binbatch.io/v1alpha1", "kind": "BatchingPolicy", "spec": spec, "status": {},
            "metadata": {"name": "fast", "namespace": "llm", "uid": "u", "generation": 1}}
    kube = Kube([])
    await reconcile(Context(kube=kube, sidecar_image=IMAGE), body, [], logging.getLogger("t"))
    svc = kube.children[("Service", "fast-binbatch-headless")]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"] == {builders.POLICY_LABEL: "fast"}
    assert {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]} == {"grpc": "bb-grpc", "http": "bb-http", "metrics": "bb-metrics"}
    assert kube.children[("Service", "fast-binbatch")]["spec"].get("clusterIP") is None  # the virtual IP stays
    kubernetes_validate.validate(svc, "1.30", strict=True)
    ctx = Context(kube=kube, sidecar_image=IMAGE)
    await reconcile(ctx, {**body, "spec": SPEC}, [], logging.getLogger("t"))
    assert ("Service", "fast-binbatch-headless") not in kube.children
    kube.reads = 0
    await reconcile(ctx, {**body, "spec": SPEC}, [], logging.getLogger("t"))
    assert kube.reads == 0  # checked once, not on every tick
    await reconcile(ctx, body, [], logging.getLogger("t"))  # on again, then off again: deleted again
    await reconcile(ctx, {**body, "spec": SPEC}, [], logging.getLogger("t"))
    assert ("Service", "fast-binbatch-headless") not in kube.children


async def test_turning_headless_off_leaves_a_service_we_did_not_make():
    kube = Kube([])
    theirs = {"kind": "Service", "metadata": {"name": "fast-binbatch-headless", "labels": {"team": "a"}}}
    kube.children[("Service", "fast-binbatch-headless")] = theirs
    body = {"metadata": {"name": "fast", "namespace": "llm", "uid": "u", "generation": 1}, "spec": SPEC, "status": {}}
    await reconcile(Context(kube=kube, sidecar_image=IMAGE), body, [], logging.getLogger("t"))
    assert kube.children[("Service", "fast-binbatch-headless")] is theirs


def test_the_headless_service_sets_no_false_field_the_api_server_would_omit():
    """A false bool comes back absent (omitempty), so ``covers`` would see a difference on every tick."""

    def falses(node, path=""):
        if node is False:
            yield path
        elif isinstance(node, dict):
            for key, value in node.items():
                yield from falses(value, f"{path}.{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                yield from falses(value, f"{path}[{i}]")

    svc = builders.build_headless_service("fast", "llm", {**SPEC, "service": {"headless": True}})
    assert list(falses(svc)) == []
    server_view = {**svc, "spec": {**svc["spec"], "clusterIPs": ["None"], "sessionAffinity": "None"}}
    assert builders.covers(server_view, svc)


@pytest.mark.parametrize("policy", ["a" * 63, "a.b", "9lives", "x" * 253])
def test_headless_names_are_valid_and_distinct_from_the_main_service(policy):
    name = builders.headless_name(policy)
    assert len(name) <= 63 and name.endswith("-binbatch-headless") and name[0].isalpha()
    assert name != builders.child_name(policy)


def test_the_gpu_sample_is_taken_over_as_documented():
    """The sample Deployment as users write it: --host/--port in args, probes on the named port."""
    from pathlib import Path

    docs = list(yaml.safe_load_all((Path(__file__).parents[2] / "manifests/samples/gpu-vllm.yaml").read_text()))
    template = next(d for d in docs if d and d["kind"] == "Deployment")["spec"]["template"]
    p = {"apiVersion": "v1", "kind": "Pod", "metadata": {**template["metadata"], "name": "qwen-0", "namespace": "llm"},
         "spec": template["spec"]}  # fmt: skip
    patch = builders.build_pod_patch(p, "qwen", 1, SPEC, IMAGE)
    engine, side = patch["spec"]["containers"]
    assert engine["args"][:6] == ["--model", "Qwen/Qwen2.5-1.5B-Instruct", "--host", "127.0.0.1", "--port", "8001"]
    assert {engine[k]["httpGet"]["port"] for k in ("startupProbe", "readinessProbe", "livenessProbe")} == {8000}
    assert ports(side)["http"] == 8000 and ports(side)["bb-http"] == 8080 and "ports" not in engine
    whole = {**p, "metadata": {**p["metadata"], **patch["metadata"]}, "spec": {**p["spec"], **patch["spec"]}}
    kubernetes_validate.validate(whole, "1.30", strict=True)


async def test_the_webhook_handler_admits_a_refused_pod_unchanged_and_patches_a_good_one():
    import kopf

    from binbatch_operator import main

    class Policies(Kube):
        async def list_policies(self, namespace):
            return [{"metadata": {"name": "fast", "namespace": namespace, "generation": 1}, "spec": SPEC}]

    memo = kopf.Memo()
    memo.ctx = Context(kube=Policies([]), sidecar_image=IMAGE)

    async def inject(p):
        patch, warnings = kopf.Patch(), []
        await main.inject_sidecar(body=kopf.Body(p), patch=patch, warnings=warnings, memo=memo,
                                  logger=logging.getLogger("t"), policies={})  # fmt: skip
        return dict(patch), warnings

    patch, warnings = await inject(pod(vllm(args=["--uds", "/run/v.sock"])))
    assert "spec" not in patch and builders.REFUSED_ANNOTATION in patch["metadata"]["annotations"]
    assert warnings and "spec.containers[0].args[0]" in warnings[0]
    patch, warnings = await inject(pod(vllm(args=["--port", "8000"])))
    assert warnings == [] and patch["spec"]["containers"][0]["args"] == ["--port", "8001", "--host", "127.0.0.1"]
