"""The BatchingPolicy CRD (generated from the sidecar's config models) and the
builder that renders a policy's spec into the sidecar's config file."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from binbatch_operator import crd
from binbatch_operator.builders import sidecar_config
from binbatch_sidecar.config import ConfigError, SidecarConfig, parse_config
from crd_admission import CASES, policy_spec

ROOT = Path(__file__).resolve().parents[2]


def walk(node, path="spec"):
    """Every (path, property schema) below ``node``."""
    for name, prop in node.get("properties", {}).items():
        yield f"{path}.{name}", prop
        yield from walk(prop, f"{path}.{name}")
        if "items" in prop:
            yield from walk(prop["items"], f"{path}.{name}[]")


def test_committed_crd_matches_the_generator():
    committed = (ROOT / crd.CRD_PATH).read_text()
    assert committed == crd.render(), "run: python -m binbatch_operator.crd (from outside the repo root)"


def test_every_field_is_described_and_every_number_bounded():
    root = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for top in ("spec", "status"):
        for path, prop in walk(root["properties"][top], top):
            if prop.get("x-kubernetes-preserve-unknown-fields"):
                continue
            assert prop.get("description"), f"{path} has no description"
            if prop.get("type") == "integer":
                assert "minimum" in prop and "maximum" in prop, f"{path} is unbounded"
        for path, prop in walk(root["properties"][top], top):
            for sub in ("items",):
                item = prop.get(sub, {})
                if item.get("type") == "integer":
                    assert "minimum" in item and "maximum" in item, f"{path}[] is unbounded"


def test_spec_sections_carry_every_sidecar_config_field():
    spec = crd.spec_schema()["properties"]
    for name in crd.CONFIG_SECTIONS:
        model = SidecarConfig.model_fields[name].annotation
        aliases = {f.alias or key for key, f in model.model_fields.items()}
        assert set(spec[name]["properties"]) == aliases | set(crd.CRD_ONLY.get(name, ())), name


def test_crd_is_namespaced_with_short_name_status_and_printer_columns():
    spec = crd.build_crd()["spec"]
    version = spec["versions"][0]
    assert spec["scope"] == "Namespaced" and spec["names"]["shortNames"] == ["bp"]
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Ready", "Pods", "Batch size", "Bins", "Age"]


def test_a_policy_spec_renders_a_config_the_sidecar_loads():
    spec = {
        "selector": {"matchLabels": {"app": "vllm"}},
        "sidecar": {"grpcPort": 7000, "metricsPort": 7001},
        "bins": {"mode": "Fixed", "count": 3, "boundaries": [64, 256], "maxOutputTokens": 1024},
        "batch": {"mode": "Gang", "staticSize": 16, "maxBatchSize": 64},
    }
    doc = sidecar_config(spec)
    cfg = parse_config(doc)
    assert cfg.bins.boundaries == [64, 256] and cfg.batch.mode == "Gang"
    assert (cfg.server.grpc_port, cfg.server.metrics_port) == (7000, 7001)
    assert "selector" not in doc and "sidecar" not in doc


# Cases of the table the offline API server and a real one judge (crd_admission.CASES), and the
# field the operator's own check names for each.
@pytest.mark.parametrize(
    ("case", "field"),
    [
        ("min above static", "spec.batch.minBatchSize"),
        ("boundaries unsorted", "spec.bins.boundaries"),
        ("Sla without tpot", "spec.latency.tpotMilliseconds"),
        ("same ports", "spec.sidecar.grpcPort"),
        ("unknown batch field", "spec.batch.staticSizee"),
    ],
)
def test_an_invalid_spec_is_refused_naming_the_field(case, field):
    with pytest.raises(ConfigError) as err:
        sidecar_config(policy_spec(CASES[case][0]))
    assert field in str(err.value)


def test_crd_yaml_is_one_document():
    docs = list(yaml.safe_load_all((ROOT / crd.CRD_PATH).read_text()))
    assert len(docs) == 1 and docs[0]["metadata"]["name"] == "batchingpolicies.binbatch.io"
