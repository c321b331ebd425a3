"""vLLM's command line as a policy needs it: ``--scheduling-policy priority`` (pure).

``batch.order: EnginePriority`` hands the order to vLLM through each request's
``priority``, which vLLM follows only when started with ``--scheduling-policy
priority``; under its default ``fcfs`` it accepts ``priority`` and ignores it, so
the order is lost without a word.  Where the webhook already rewrites vLLM's
command line (the port take-over) it adds the flag when the pod does not give one;
a value the pod states is never changed (that is the pod author's choice, and a
policy is not told apart from a typo): it is reported instead, like every pod
whose vLLM lacks the flag, in the policy's status and as an Event.  Nothing is
refused.

vLLM's parser takes ``--scheduling-policy X`` and ``--scheduling-policy=X``, with
underscores as well as dashes in the name (``--scheduling_policy``) and, being
argparse, any unambiguous prefix (``--scheduling``); the last one wins, and the
command line beats a ``--config`` file.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FLAG = "--scheduling-policy"
SHORTEST = "--scheduling"  # argparse takes a prefix no other option shares; vLLM's others start --scheduler
PRIORITY = "priority"
SHELLS = frozenset({"sh", "bash", "dash", "ash", "zsh", "ksh", "busybox"})


def wanted(spec: Mapping[str, Any]) -> bool:
    """The policy hands the order to vLLM (``batch.order: EnginePriority``)."""
    return (spec.get("batch") or {}).get("order") == "EnginePriority"


@dataclass(frozen=True)
class Given:
    value: str
    field: str  # where the pod states it, e.g. spec.containers[0].args[3]


def _words(token: str) -> list[str]:
    """A command-line argument as vLLM would see its words (a shell script's are split)."""
    if not any(c.isspace() for c in token):
        return [token]
    try:
        return shlex.split(token)
    except ValueError:
        return token.split()


def given(container: Mapping[str, Any], base: str) -> Given | None:
    """The ``--scheduling-policy`` the container's command line gives (the last one), or None."""
    found = None
    for where in ("command", "args"):
        tokens = [str(t) for t in container.get(where) or []]
        words = [(w, f"{base}.{where}[{j}]") for j, token in enumerate(tokens) for w in _words(token)]
        for k, (word, field) in enumerate(words):
            name, eq, value = word.partition("=")
            name = name.replace("_", "-")
            if FLAG.startswith(name) and len(name) >= len(SHORTEST):
                found = Given(value if eq else (words[k + 1][0] if k + 1 < len(words) else ""), field)
    return found


@dataclass(frozen=True)
class Finding:
    """Why a pod's vLLM may not order by priority: ``certain`` False when its command line cannot tell."""

    text: str
    certain: bool = True


def check(pod_spec: Mapping[str, Any], index: int) -> Finding | None:
    """What keeps the vLLM container ``index`` from ordering by priority; None when it runs the flag."""
    container = (pod_spec.get("containers") or [])[index]
    base = f"spec.containers[{index}]"
    stated = given(container, base)
    if stated is not None and stated.value == PRIORITY:
        return None
    if stated is not None and "$" in stated.value:
        return Finding(f"{stated.field}: {FLAG} {stated.value} comes from a variable the operator cannot read", False)
    if stated is not None:
        return Finding(f"{stated.field}: {FLAG} {stated.value or '(no value)'}")
    command = [str(t) for t in container.get("command") or []]
    if not command and not container.get("args"):
        return Finding(f"{base}: vLLM's arguments come from the image, which the operator cannot read", False)
    if command and command[0].rsplit("/", 1)[-1] in SHELLS:
        return Finding(f"{base}.command: vLLM starts through a shell, whose arguments the operator cannot follow", False)
    if any(w.partition("=")[0] == "--config" for t in [*command, *map(str, container.get("args") or [])] for w in _words(t)):
        return Finding(f"{base}.args: no {FLAG}, and the --config file vLLM reads may set it", False)
    return Finding(f"{base}.{'args' if container.get('args') else 'command'}: no {FLAG} (vLLM's default is fcfs)")


def add_priority(container: dict[str, Any], base: str) -> None:
    """Append ``--scheduling-policy priority`` to a command line that gives none (args, else command)."""
    if given(container, base) is None:
        target = "args" if container.get("args") else "command"
        container[target] = [*(container.get(target) or []), FLAG, PRIORITY]
