"""What an install lets a policy ask for: which sidecar images, and which URLs the sidecar may call.

A BatchingPolicy is written by whoever may write one in its namespace, but the
operator injects what it says into other people's pods: an image of the
policy's choosing would run next to the model server with the pod's service
account, and an engine, metrics or predictor URL is where the sidecar sends
every prompt (or scrapes).  So the install (the Helm chart's ``allowedImages``
and ``allowRemoteUrls``, passed as environment variables) bounds both, and a
policy that asks for more is refused naming the field, exactly like an invalid
spec: status ``Valid=False``, and no pod is injected with it.

- ``BINBATCH_ALLOWED_IMAGES``: comma-separated image patterns.  An entry with
  ``*``, ``?`` or ``[`` is a glob over the whole reference (``fnmatch``); any other
  entry is a repository (``ghcr.io/binbatch/binbatch`` allows its tags and
  digests, not ``ghcr.io/binbatch/binbatch-other``), or, ending in ``/``, a
  registry path prefix.  Unset or empty: the operator's own sidecar image's
  repository only.  ``*`` allows every image.  The install's default sidecar
  image is always allowed (a policy that names no image gets it).
- ``BINBATCH_ALLOW_REMOTE_URLS``: ``"true"`` lets ``spec.engine.url``,
  ``spec.metrics.url``, ``spec.predictor.external.url`` and ``feedbackUrl`` name
  any host; otherwise each must be the pod's loopback (127.0.0.1, localhost,
  [::1]), where vLLM runs beside the sidecar.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .crd import LOOPBACK_URL

IMAGES_ENV = "BINBATCH_ALLOWED_IMAGES"
REMOTE_ENV = "BINBATCH_ALLOW_REMOTE_URLS"
# The URLs a spec may set, by the path the user writes them at.
URL_FIELDS = (
    ("spec.engine.url", ("engine", "url")),
    ("spec.metrics.url", ("metrics", "url")),
    ("spec.predictor.external.url", ("predictor", "external", "url")),
    ("spec.predictor.external.feedbackUrl", ("predictor", "external", "feedbackUrl")),
)
_GLOB = re.compile(r"[*?\[]")


def repository(image: str) -> str:
    """``registry/path/name`` of an image reference, without its tag or digest."""
    name = image.split("@", 1)[0]
    slash = name.rfind("/")
    colon = name.rfind(":")
    return name[:colon] if colon > slash else name


def image_allowed(image: str, patterns: tuple[str, ...]) -> bool:
    for pattern in patterns:
        if _GLOB.search(pattern):
            if fnmatch.fnmatchcase(image, pattern):
                return True
        elif pattern.endswith("/"):
            if image.startswith(pattern):
                return True
        elif repository(image) == pattern:
            return True
    return False


@dataclass(frozen=True)
class Allowlist:
    """The install's bounds on a policy (see the module docstring); the default allows only ``default_image``."""

    default_image: str
    images: tuple[str, ...] = field(default=())  # empty: the default image's repository
    remote_urls: bool = False

    @classmethod
    def from_environment(cls, default_image: str, env: Mapping[str, str] | None = None) -> Allowlist:
        env = os.environ if env is None else env
        images = tuple(p.strip() for p in env.get(IMAGES_ENV, "").split(",") if p.strip())
        remote = env.get(REMOTE_ENV, "false").strip().lower()
        if remote not in ("true", "false", ""):
            raise ValueError(f"{REMOTE_ENV} must be true or false, got {env[REMOTE_ENV]!r}")
        return cls(default_image, images, remote == "true")

    @property
    def patterns(self) -> tuple[str, ...]:
        return self.images or (repository(self.default_image),)

    def problems(self, spec: Mapping[str, Any]) -> list[tuple[str, str]]:
        """What ``spec`` asks for beyond the install's bounds, as ``(field, message)``."""
        found: list[tuple[str, str]] = []
        image = (spec.get("sidecar") or {}).get("image")
        if image and image != self.default_image and not image_allowed(str(image), self.patterns):
            found.append(("spec.sidecar.image", f"{image!r} is not allowed by this install (allowedImages: "
                                                f"{', '.join(self.patterns)})"))  # fmt: skip
        if not self.remote_urls:
            for path, keys in URL_FIELDS:
                value: Any = spec
                for key in keys:
                    value = value.get(key) if isinstance(value, Mapping) else None
                if value and re.fullmatch(LOOPBACK_URL, str(value)) is None:
                    found.append((path, f"must name the pod's loopback (127.0.0.1, localhost or [::1]) unless the "
                                        f"install sets allowRemoteUrls: true; got {value!r}"))  # fmt: skip
        return found
