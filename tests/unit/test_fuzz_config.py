"""The config parsers under generated input, at CI scale: the generators of ``binbatch
bench fuzz`` (sidecar/bench/fuzz.py), seeded by hypothesis.  A sidecar config document,
a config file's bytes, or a BatchingPolicy spec through the operator's builders gives a
valid config or a ConfigError naming the field -- never another exception.  Then the
regressions of what the bench found, and the bench's own oracle and generators."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from binbatch_operator import builders
from binbatch_sidecar.bench import fuzz
from binbatch_sidecar.config import ConfigError, parse_config_bytes


@settings(max_examples=800, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(seed=st.integers(0, 2**64 - 1))
def test_generated_configs_and_specs_give_a_config_or_a_config_error(seed):
    case = fuzz.config_case(fuzz.case_rng(seed, "config", 0))
    answer = fuzz.run_config_case(case)
    assert answer.failure is None, (case.kind, answer.text)
    assert answer.status in ("ok", "ConfigError")


@pytest.mark.parametrize(
    ("text", "says"),
    [(b"engine:\n  url: " + b"[" * 600 + b"]" * 600, "nested too deeply"),
     (b"batch:\n  mode: 2001-02-30\n", "cannot be read"),
     (b"bins:\n  count: !!int 1e9\n", "cannot be read"),
     (b"metrics:\n  intervalMilliseconds: !!float abc\n", "cannot be read")],
)  # fmt: skip
def test_yaml_that_pyyaml_cannot_build_is_a_config_error_naming_the_file(text, says):
    with pytest.raises(ConfigError) as info:
        parse_config_bytes(text, "/etc/binbatch/sidecar.yaml")
    assert info.value.problems[0][0] == "/etc/binbatch/sidecar.yaml" and says in info.value.problems[0][1]


@pytest.mark.parametrize(
    ("spec", "field"),
    [({"selector": {}, "engine": 5}, "spec.engine"),
     ({"selector": {}, "bins": ["count", 3]}, "spec.bins"),
     ({"selector": {}, "sidecar": "x"}, "spec.sidecar"),
     ({"selector": {}, "service": True}, "spec.service"),
     ({"selector": {}, "sidecar": {"takeOverServingPort": 8001}}, "spec.sidecar.takeOverServingPort"),
     ([1, 2], "spec")],
)  # fmt: skip
def test_a_spec_section_that_is_not_an_object_is_a_config_error_naming_it(spec, field):
    with pytest.raises(ConfigError) as info:
        builders.sidecar_config(spec)
    assert [path for path, _ in info.value.problems] == [field]
    assert "must be an object" in info.value.problems[0][1]


def test_passthrough_paths_that_are_not_a_list_are_a_config_error_not_a_type_error():
    with pytest.raises(ConfigError) as info:
        builders.sidecar_config({"selector": {}, "sidecar": {"passthroughPaths": 5}})
    assert any("passthroughPaths" in path for path, _ in info.value.problems)


def test_the_same_seed_makes_the_same_inputs_and_another_seed_others():
    again = [fuzz.http_case(fuzz.case_rng(7, "http", i), "m").request for i in range(20)]
    assert again == [fuzz.http_case(fuzz.case_rng(7, "http", i), "m").request for i in range(20)]
    assert again != [fuzz.http_case(fuzz.case_rng(8, "http", i), "m").request for i in range(20)]
    grpc_cases = [fuzz.grpc_case(fuzz.case_rng(7, "grpc", i), "m") for i in range(20)]
    assert grpc_cases == [fuzz.grpc_case(fuzz.case_rng(7, "grpc", i), "m") for i in range(20)]


@pytest.mark.parametrize(
    ("data", "status", "failed"),
    [(b"", "closed", False),
     (b"HTTP/1.1 400 Bad Request\r\n\r\n{}", "400", False),
     (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n\r\n{}", "200", False),
     (b"HTTP/1.1 500 Internal Server Error\r\n\r\noops", "500", True),
     (b"HTTP/1.1 503 Service Unavailable\r\n\r\n", "503", True),
     (b"HTTP/1.1 400 Bad Request\r\n\r\nTraceback (most recent call last):", "400", True),
     (b'HTTP/1.1 400 Bad Request\r\n\r\n  File "/app/x.py", line 3', "400", True),
     (b"HTTP/1.1 400 Bad Request\r\n\r\nengine http://127.0.0.1:8000 refused", "400", True),
     (b"SSH-2.0", "garbled", True)],
)  # fmt: skip
def test_the_http_oracle_refuses_5xx_tracebacks_and_loopback_addresses(data, status, failed):
    answer = fuzz.judge_http(data)
    assert answer.status == status and (answer.failure is not None) == failed


def test_json_with_holes_writes_what_python_json_cannot():
    value = {"a": fuzz.Raw("1e999"), "b": fuzz.Pairs((("k", 1), ("k", 2))), "c": float("nan"), "d": "\ud800"}
    assert fuzz.dump_json(value) == '{"a":1e999,"b":{"k":1,"k":2},"c":NaN,"d":"\\ud800"}'


def test_a_504_is_the_callers_own_deadline_only_when_the_request_set_one():
    timed_out = b'HTTP/1.1 504 Gateway Timeout\r\n\r\n{"error": {"code": "deadline_exceeded"}}'
    assert fuzz.judge_http(timed_out, deadline=True).failure is None
    assert fuzz.judge_http(timed_out, deadline=True).status == fuzz.DEADLINE_504
    assert fuzz.judge_http(timed_out, deadline=False).failure == "HTTP 504"
