"""Port take-over: the sidecar's HTTP door on the vLLM container's own serving port.

With ``spec.sidecar.takeOverServingPort.enabled`` the webhook rewrites a new pod
so that whatever already reaches vLLM on its port (a Service, a gateway, an
InferencePool, a ServiceMonitor) reaches the sidecar instead, with no change on
their side:

- vLLM's arguments get ``--host 127.0.0.1 --port <enginePort>``: an existing
  ``--port``/``--host`` (``--port 8000`` or ``--port=8000``, in ``command`` or in
  ``args``) is rewritten where it stands, an absent one is appended; with
  ``batch.order: EnginePriority``, ``--scheduling-policy priority`` is appended
  unless the pod gives one (vllm_args.py);
- the sidecar's HTTP door listens on the serving port as well
  (``--take-over-port``), beside its own ``httpPort`` (``bb-http``, which the
  policy's Service targets); vLLM's own entries for the serving port move to
  the sidecar with their names (a bare entry when it had none), so a Service's
  or a PodMonitor's named ``targetPort`` still resolves (to the container that
  now listens there) and every port is declared once in the pod: the API server
  warns about a port declared twice;
- the vLLM container's probes and lifecycle hooks that named a moved port get
  its number (kubelet resolves a named probe port in the probe's own container).
  They keep probing the serving port, now answered by the sidecar (``/health``
  itself, every other path passed through to vLLM): kubelet cannot reach a port
  bound to the pod's loopback, so a probe cannot follow vLLM to ``enginePort``.

The sidecar's engine URL (and a scraped metrics URL on the loopback) gets the
engine port in the rendered config (``builders.sidecar_config``).  Whatever
cannot be rewritten safely — a shell command line, a port from an env var whose
value the pod spec does not hold, a ``--config`` file that may set the port, TLS
or a unix socket, a port another container declares — raises
``TakeOverRefused`` naming the pod field; the pod is then admitted without a
sidecar, never half-patched.  Pure functions on plain dicts, like builders.py.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from binbatch_sidecar.config import EngineConfig, MetricsConfig

from . import vllm_args
from .crd import LOOPBACK_URL, SIDECAR_DEFAULTS, TAKEOVER_DEFAULTS
from .vllm_args import SHELLS

VLLM_DEFAULT_PORT = 8000  # vLLM's --port default
LOOPBACK = "127.0.0.1"
POLICY_FIELD = "spec.sidecar.takeOverServingPort"
# Flags that make the serving port something the sidecar's plain-HTTP door cannot stand in for.
UNSUPPORTED_FLAGS = {
    "--uds": "vLLM serves on a unix socket (--uds), not on a TCP port",
    "--ssl-keyfile": "vLLM serves TLS (--ssl-keyfile); the sidecar's door is plain HTTP",
    "--ssl-certfile": "vLLM serves TLS (--ssl-certfile); the sidecar's door is plain HTTP",
}
_ENV_REF = re.compile(r"\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)")
_PROBES = ("livenessProbe", "readinessProbe", "startupProbe")
SIDECAR_PORT_NAMES = ("bb-grpc", "bb-http", "bb-metrics")  # the injected container's own port names


class TakeOverRefused(ValueError):
    """A pod the take-over cannot rewrite safely; ``field`` is the pod field (or policy field) to change."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


@dataclass(frozen=True)
class TakeOverPlan:
    """How one pod is rewritten: the vLLM container as it will run, and what the sidecar takes."""

    index: int  # of the vLLM container in spec.containers
    container: dict[str, Any]  # the vLLM container, rewritten
    serving_port: int  # the port the sidecar's HTTP door listens on
    engine_port: int  # vLLM's new port, on 127.0.0.1
    serving_ports: list[dict[str, Any]]  # the sidecar's entries for the serving port: vLLM's named ones, or a bare one


def settings(spec: Mapping[str, Any]) -> dict[str, Any]:
    """``spec.sidecar.takeOverServingPort`` with its defaults filled in."""
    given = ((spec.get("sidecar") or {}).get("takeOverServingPort")) or {}
    return {key: given.get(key, default) for key, default in TAKEOVER_DEFAULTS.items()}


def enabled(spec: Mapping[str, Any]) -> bool:
    return bool(settings(spec)["enabled"])


def _loopback(url: str) -> bool:
    return re.fullmatch(LOOPBACK_URL, url) is not None


def engine_url(spec: Mapping[str, Any]) -> str:
    return str((spec.get("engine") or {}).get("url") or EngineConfig.model_fields["url"].default)


def spec_problems(spec: Mapping[str, Any]) -> list[tuple[str, str]]:
    """What the CRD's CEL rules refuse about the take-over, for a spec the API server did not check."""
    if not enabled(spec):
        return []
    side = spec.get("sidecar") or {}
    engine_port = settings(spec)["enginePort"]
    problems = [
        (f"{POLICY_FIELD}.enginePort", f"must differ from spec.sidecar.{name} (both {engine_port})")
        for name in ("grpcPort", "httpPort", "metricsPort") if side.get(name, SIDECAR_DEFAULTS[name]) == engine_port
    ]  # fmt: skip
    url = engine_url(spec)
    if not _loopback(url):
        problems.append(("spec.engine.url", f"must name the pod's loopback (127.0.0.1 or localhost) when {POLICY_FIELD} "
                                            f"is enabled: the sidecar then reaches vLLM at 127.0.0.1:enginePort; got {url!r}"))  # fmt: skip
    return problems


def with_port(url: str, port: int) -> str:
    """``url`` with its port replaced (scheme, host, path and query kept)."""
    parts = urlsplit(url)
    host = parts.hostname or LOOPBACK
    host = f"[{host}]" if ":" in host else host
    return urlunsplit(parts._replace(netloc=f"{host}:{port}"))


def config_urls(spec: Mapping[str, Any], doc: dict[str, Any]) -> None:
    """Point the rendered sidecar config at vLLM's new port: engine.url, and a scrape of the loopback."""
    if not enabled(spec):
        return
    engine_port = settings(spec)["enginePort"]
    url = engine_url(spec)
    if _loopback(url):  # else spec_problems names it
        doc["engine"] = {**(doc.get("engine") or {}), "url": with_port(url, engine_port)}
    metrics = doc.get("metrics") or {}
    source = metrics.get("source", MetricsConfig.model_fields["source"].default)
    scrape = str(metrics.get("url") or MetricsConfig.model_fields["url"].default)
    if source == "Scrape" and _loopback(scrape):
        doc["metrics"] = {**metrics, "url": with_port(scrape, engine_port)}


# -- the pod -------------------------------------------------------------------------------


def _names_vllm(container: Mapping[str, Any]) -> bool:
    words = [str(container.get("image") or ""), *map(str, container.get("command") or []), *map(str, container.get("args") or [])]
    return any("vllm" in w.lower() for w in words)


def find_container(pod_spec: Mapping[str, Any], name: str) -> int:
    """Index of the vLLM container: the named one, the only one, or the only one that names vllm."""
    containers = list(pod_spec.get("containers") or [])
    if name:
        for i, c in enumerate(containers):
            if c.get("name") == name:
                return i
        raise TakeOverRefused("spec.containers", f"no container named {name!r} ({POLICY_FIELD}.container)")
    if len(containers) == 1:
        return 0
    named = [i for i, c in enumerate(containers) if _names_vllm(c)]
    if len(named) == 1:
        return named[0]
    which = ", ".join(str(containers[i].get("name")) for i in named) if named else "none"
    raise TakeOverRefused("spec.containers", f"cannot tell which of {len(containers)} containers is vLLM "
                                             f"(naming vllm: {which}); set {POLICY_FIELD}.container")  # fmt: skip


def _port_value(text: str, container: Mapping[str, Any], field: str) -> int:
    """A ``--port`` value as kubelet will pass it: a number, or ``$(VAR)`` of a literal env value."""
    ref = _ENV_REF.fullmatch(text)
    if ref:
        var = ref.group(1)
        entry = next((e for e in container.get("env") or [] if e.get("name") == var), None)
        if entry is None:
            raise TakeOverRefused(field, f"--port is $({var}), which the container's env does not define (envFrom "
                                         "or the image may set it; the webhook cannot read them); give the port as a number")  # fmt: skip
        if "valueFrom" in entry or "value" not in entry:
            raise TakeOverRefused(field, f"--port is $({var}), set by valueFrom (a ConfigMap, Secret or field the "
                                         "webhook cannot read); give the port as a number or a literal env value")  # fmt: skip
        text = str(entry["value"])
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise TakeOverRefused(field, f"--port {text!r} is not a port number")
    return int(text)


@dataclass
class _Flag:
    where: str  # "command" | "args"
    index: int  # of the value token (joined: of the --flag=value token)
    value: str
    joined: bool


def _scan(c: Mapping[str, Any], base: str) -> tuple[list[_Flag], list[_Flag], bool]:
    """Every ``--port`` and ``--host`` in the container's command line, and whether ``--config`` is given."""
    ports: list[_Flag] = []
    hosts: list[_Flag] = []
    config = False
    for where in ("command", "args"):
        tokens = [str(t) for t in c.get(where) or []]
        for j, tok in enumerate(tokens):
            field = f"{base}.{where}[{j}]"
            flag, eq, value = tok.partition("=")
            if flag in ("--port", "--host"):
                found = ports if flag == "--port" else hosts
                if eq:
                    found.append(_Flag(where, j, value, True))
                elif j + 1 < len(tokens):
                    found.append(_Flag(where, j + 1, tokens[j + 1], False))
                else:
                    raise TakeOverRefused(field, f"{flag} has no value after it in {where}")
            elif flag in UNSUPPORTED_FLAGS:
                raise TakeOverRefused(field, UNSUPPORTED_FLAGS[flag])
            elif flag == "--config":
                config = True
            elif "--port" in tok or "--host" in tok:
                raise TakeOverRefused(field, f"{tok!r} holds --port/--host inside a longer argument; the webhook "
                                             "rewrites only separate arguments (--port 8000 or --port=8000)")  # fmt: skip
    return ports, hosts, config


def _set(c: dict[str, Any], flag: _Flag, name: str, value: str) -> None:
    c[flag.where][flag.index] = f"{name}={value}" if flag.joined else value


def _renumber(handler: Any, moved: set[str], port: int) -> None:
    """A probe or hook that names a moved port gets its number (names resolve in the probe's own container)."""
    if not isinstance(handler, dict):
        return
    for kind in ("httpGet", "tcpSocket"):
        action = handler.get(kind)
        if isinstance(action, dict) and action.get("port") in moved:
            action["port"] = port


def _unprivileged_port_start(pod_spec: Mapping[str, Any]) -> int:
    """The lowest port a process without NET_BIND_SERVICE may bind: the pod's sysctl, else Linux's 1024."""
    for sysctl in ((pod_spec.get("securityContext") or {}).get("sysctls")) or []:
        if sysctl.get("name") == "net.ipv4.ip_unprivileged_port_start" and str(sysctl.get("value", "")).isdigit():
            return int(sysctl["value"])
    return 1024


def _declared_elsewhere(pod_spec: Mapping[str, Any], index: int, port: int) -> str | None:
    for group in ("initContainers", "containers"):
        for i, c in enumerate(pod_spec.get(group) or []):
            if group == "containers" and i == index:
                continue
            for j, p in enumerate(c.get("ports") or []):
                if p.get("containerPort") == port:
                    return f"spec.{group}[{i}].ports[{j}]"
    return None


def plan(pod: Mapping[str, Any], spec: Mapping[str, Any], reserved: Mapping[str, int]) -> TakeOverPlan:
    """How to take over ``pod``'s serving port; raises ``TakeOverRefused`` if it cannot be done safely.

    ``reserved`` are the sidecar's own ports by policy field (grpcPort,
    httpPort, metricsPort): the door on the serving port must not collide with them.
    """
    pod_spec = pod.get("spec") or {}
    choice = settings(spec)
    engine_port = int(choice["enginePort"])
    index = find_container(pod_spec, str(choice["container"] or ""))
    c = copy.deepcopy(dict((pod_spec.get("containers") or [])[index]))
    base = f"spec.containers[{index}]"
    command = [str(t) for t in c.get("command") or []]
    if command and command[0].rsplit("/", 1)[-1] in SHELLS:
        raise TakeOverRefused(f"{base}.command", f"vLLM is started through a shell ({command[0]}); the webhook cannot "
                                                 "rewrite a script's port safely: list vLLM's arguments in command/args")  # fmt: skip
    ports, hosts, config = _scan(c, base)
    if ports:
        serving = [_port_value(f.value, c, f"{base}.{f.where}[{f.index}]") for f in ports][-1]  # argparse: the last wins
    elif config:
        raise TakeOverRefused(f"{base}.args", "vLLM reads a --config file that may set its port, which the webhook "
                                              "cannot read; give --port in args")  # fmt: skip
    else:
        serving = VLLM_DEFAULT_PORT
    if not (c.get("command") or c.get("args")):
        raise TakeOverRefused(f"{base}.args", "vLLM's arguments come from the image (the container has no command "
                                              "or args), which the webhook cannot see or extend; list them in args")  # fmt: skip
    if serving == engine_port:
        raise TakeOverRefused(f"{POLICY_FIELD}.enginePort", f"equals the pod's serving port {serving}")
    if serving < _unprivileged_port_start(pod_spec):
        raise TakeOverRefused(f"{base}.args", f"the serving port {serving} is privileged (below 1024) and the sidecar "
                                              "runs as non-root without capabilities; set the pod's sysctl "
                                              "net.ipv4.ip_unprivileged_port_start, or serve vLLM on a port >= 1024")  # fmt: skip
    for name, port in reserved.items():
        if port == serving:
            raise TakeOverRefused(f"spec.sidecar.{name}", f"equals the pod's serving port {serving}, where the sidecar's "
                                                          "HTTP door listens too: choose another port")  # fmt: skip
    for port, role in ((serving, "the serving port the sidecar takes over"), (engine_port, "enginePort, where vLLM moves")):
        other = _declared_elsewhere(pod_spec, index, port)
        if other:
            raise TakeOverRefused(other, f"another container declares port {port}, {role}")

    for where in ("command", "args"):
        if c.get(where):
            c[where] = [str(t) for t in c[where]]
    for f in ports:
        _set(c, f, "--port", str(engine_port))
    for f in hosts:
        _set(c, f, "--host", LOOPBACK)
    extra = ([] if hosts else ["--host", LOOPBACK]) + ([] if ports else ["--port", str(engine_port)])
    if extra:
        target = "args" if c.get("args") else "command"
        c[target] = [*c[target], *extra]
    if vllm_args.wanted(spec):  # batch.order EnginePriority: vLLM ignores request priorities without it
        vllm_args.add_priority(c, base)

    own = list(c.get("ports") or [])
    served = [p for p in own if p.get("containerPort") == serving and p.get("protocol", "TCP") == "TCP"]
    # One with a name or a hostPort is someone's reference, kept as it is; else the port is declared bare.
    moved = [dict(p) for p in served if p.get("name") or p.get("hostPort")] or [{"containerPort": serving, "protocol": "TCP"}]
    kept = [p for p in own if p not in served]
    if kept:
        c["ports"] = kept
    else:
        c.pop("ports", None)
    names = {str(p["name"]) for p in moved if p.get("name")}
    clash = names & set(SIDECAR_PORT_NAMES)
    if clash:
        raise TakeOverRefused(f"{base}.ports", f"the serving port is named {sorted(clash)[0]!r}, a name the sidecar uses itself")
    for key in _PROBES:
        _renumber(c.get(key), names, serving)
    for hook in ((c.get("lifecycle") or {}).values()):
        _renumber(hook, names, serving)
    return TakeOverPlan(index=index, container=c, serving_port=serving, engine_port=engine_port, serving_ports=moved)
