"""The sidecar config file: schema, error messages, and reload (binbatch_sidecar.config)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
import yaml

from binbatch_sidecar.config import (
    CALLER_INPUTS,
    ConfigError,
    SidecarConfig,
    config_json,
    dump_config,
    load_config,
    parse_config,
    restart_required,
)

FULL = """\
engine:
  url: https://vllm.example:8443
  model: meta-llama/Llama-3.1-8B-Instruct
  requestTimeoutSeconds: 120
  healthPath: /healthz
  maxRequestBodyBytes: 524288
  apiKeyFile: /var/run/binbatch/engine-key/api-key
bins:
  mode: Fixed
  count: 4
  countMode: Fixed
  latencyTargetMilliseconds: 3000
  boundaries: [64, 256, 1024]
  maxOutputTokens: 4096
  autoWindow: 1024
  autoRefreshEvery: 64
  splitThresholdPercent: 70
  maxRequestsPerBin: 128
batch:
  mode: Gang
  sizing: Sla
  staticSize: 16
  minBatchSize: 2
  maxBatchSize: 64
  maxWaitMilliseconds: 250
  maxInflightBatches: 2
  maxQueuedRequests: 500
  dispatch: Smdp
  smdpEngineWeight: 8
  order: Fifo
  aging: Fixed
  agingTokensPerSecond: 25
  maxQueueWaitMilliseconds: 30000
  followEngineQueue: false
  drainOrder: ShortestFirst
  shortestBy: KvFootprint
  maxQueuedBytes: 67108864
memory:
  admission: Projected
  overflowPerMille: 5
  kvReservePercent: 10
  kvSaturationPercent: 90
latency:
  tpotMilliseconds: 50
  ttftMilliseconds: 2000
  queueSharePercent: 25
  tolerancePercent: 20
predictor:
  kind: Learned
  defaultOutputTokens: 128
  warmStart: /models/length.npz
  warmStartOptional: true
  refitEveryRecords: 512
  trainingBufferRecords: 2048
  external:
    url: http://length-predictor.ml.svc:9000/predict
    timeoutMilliseconds: 30
    breakerOpenMilliseconds: 2000
    feedbackUrl: http://length-predictor.ml.svc:9000/completions
metrics:
  source: PromQL
  url: http://prometheus.monitoring:9090
  intervalMilliseconds: 1000
  staleAfterMilliseconds: 5000
  promqlSelector: '{pod="vllm-0"}'
server:
  grpcPort: 7000
  httpPort: 7002
  metricsPort: 7001
  drainGraceSeconds: 10
  configPollMilliseconds: 2000
  passthroughPaths: [/tokenize, /v1/embeddings]
  maxRequestBytes: 1048576
  httpRequestReadTimeoutMilliseconds: 10000
  maxConnections: 256
  grpcMaxConcurrentStreams: 100
  grpcMaxConnectionAgeSeconds: 3600
logging:
  level: Debug
  format: Text
  logPrompts: true
classes:
  classes:
  - name: interactive
    priority: 100
    allowHints: true
    allowPriority: true
    allowSloHeaders: true
  - name: batch
    priority: -100
    allowHints: false
    allowPriority: false
    allowSloHeaders: false
  default:
    allowHints: true
    allowPriority: false
    allowSloHeaders: false
auth:
  callerTokensDir: /var/run/binbatch/caller-tokens
  callers:
  - name: team-a
    allowHints: true
    allowPriority: false
    allowSloHeaders: true
  adminTokenFile: /var/run/binbatch/admin-token/admin-token
  operatorPublicKeys:
  - |
    -----BEGIN PUBLIC KEY-----
    MCowBQYDK2VwAyEAgoXj97IHCOLi2QCpn/tUSSdL+DKfBJ3eYGLEKWVWZP4=
    -----END PUBLIC KEY-----
  audience: llm/chat
tenants:
  tenants:
  - name: team-a
    weight: 3
  - name: "llm-d flow/7"
    weight: 1
  defaultWeight: 2
  maxQueuedSharePercent: 25
"""


def problems_of(doc: Any) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as err:
        parse_config(doc)
    assert str(err.value) == "\n".join(f"{p}: {m}" for p, m in err.value.problems)
    return err.value.problems


def test_no_document_gives_the_defaults():
    cfg = parse_config(None)
    assert cfg == parse_config({}) == SidecarConfig()
    assert cfg.engine.url == "http://127.0.0.1:8000"
    assert (cfg.bins.mode, cfg.bins.count, cfg.bins.boundaries) == ("Fixed", 4, [])
    assert (cfg.batch.mode, cfg.batch.sizing, cfg.batch.dispatch) == ("Continuous", "Combined", "MaxWait")
    with pytest.raises(ConfigError, match=r"batch\.dispatch"):
        parse_config({"batch": {"dispatch": "Smdp"}})  # the SMDP policy is in the core, not yet in the sidecar
    assert (cfg.server.grpc_port, cfg.server.metrics_port) == (50051, 9090)
    assert cfg.logging.level == "Info" and not cfg.logging.log_prompts
    assert cfg.logging.format == "Json"


def test_defaults_convert_to_si_units():
    cfg = SidecarConfig()
    assert cfg.max_wait_seconds == 0  # a request goes as soon as the engine has room
    assert cfg.eps_m == pytest.approx(0.010)
    assert cfg.tpot_seconds is None and cfg.queue_budget_seconds(None) is None
    assert cfg.queue_budget_seconds(400) == pytest.approx(0.2)  # a request's own SLO, 50% of it
    assert cfg.eps_d == pytest.approx(0.10)
    assert cfg.kv_reserve_ratio == 0 and cfg.kv_saturation == pytest.approx(0.95)
    assert cfg.scrape_interval_seconds == pytest.approx(0.5)
    assert cfg.stale_after_seconds == pytest.approx(3.0)


def test_full_example_parses_every_key():
    cfg = parse_config(yaml.safe_load(FULL))
    assert cfg.engine.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert cfg.bins.boundaries == [64, 256, 1024]
    assert (cfg.batch.mode, cfg.batch.sizing, cfg.batch.static_size) == ("Gang", "Sla", 16)
    assert cfg.metrics.promql_selector == '{pod="vllm-0"}'
    assert cfg.logging.log_prompts is True and cfg.logging.format == "Text"
    assert cfg.predictor.external.timeout_milliseconds == 30
    assert cfg.predictor.warm_start_optional is True
    assert cfg.tpot_seconds == pytest.approx(0.05)
    assert cfg.queue_budget_seconds(None) == pytest.approx(2.0 * 0.25)  # the policy's SLO, 25% of it
    assert cfg.queue_budget_seconds(800) == pytest.approx(0.8 * 0.25)
    assert cfg.eps_m == pytest.approx(0.005) and cfg.kv_reserve_ratio == pytest.approx(0.10)
    assert cfg.auth.callers_on and cfg.auth.inputs_of("team-a").allows("slo") and not cfg.auth.inputs_of("team-a").allows("priority")
    assert cfg.auth.inputs_of("unlisted").allows("priority")  # a caller not listed: its class decides
    # the dump spells the file's keys back, and round-trips
    assert dump_config(cfg) == yaml.safe_load(FULL)
    assert parse_config(dump_config(cfg)) == cfg


def test_config_json_is_sorted_camel_case_json():
    text = config_json(SidecarConfig())
    assert json.loads(text)["memory"]["admission"] == "Auto"
    assert text == json.dumps(json.loads(text), sort_keys=True)
    assert '"staticSize": 32' in text


def test_sections_accept_snake_case_names_from_python():
    assert SidecarConfig(batch={"static_size": 8, "min_batch_size": 8}).batch.static_size == 8


def test_config_is_frozen():
    cfg = SidecarConfig()
    with pytest.raises(ValueError):
        cfg.batch.static_size = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("doc", "path", "words"),
    [
        ({"batch": {"minBatchSize": 64}}, "batch.minBatchSize", "<= staticSize (32)"),
        ({"batch": {"staticSize": 300}}, "batch.staticSize", "<= maxBatchSize (256)"),
        ({"bins": {"boundaries": [100, 200]}}, "bins.boundaries", "count-1 = 3 entries, got 2"),
        ({"bins": {"boundaries": [100, 100, 200]}}, "bins.boundaries", "strictly increasing"),
        ({"bins": {"boundaries": [100, 50, 200]}}, "bins.boundaries", "strictly increasing"),
        ({"bins": {"boundaries": [0, 50, 200]}}, "bins.boundaries", "entry 0 must be between 1"),
        ({"bins": {"boundaries": [100, 200, 2048]}}, "bins.boundaries", "below maxOutputTokens (2048)"),
        ({"bins": {"mode": "Auto", "boundaries": [1, 2, 3]}}, "bins.boundaries", "empty unless mode is Fixed"),
        ({"bins": {"mode": "Adaptive", "boundaries": [1, 2, 3]}}, "bins.boundaries", "empty unless mode is Fixed"),
        ({"batch": {"sizing": "Sla"}}, "latency.tpotMilliseconds", "> 0 when batch.sizing is Sla"),
        ({"metrics": {"intervalMilliseconds": 2000}}, "metrics.staleAfterMilliseconds", ">= 2 x intervalMilliseconds"),
        ({"server": {"grpcPort": 7070, "httpPort": 7070}}, "server.grpcPort", "must differ from httpPort"),
        ({"server": {"grpcPort": 7070, "metricsPort": 7070}}, "server.grpcPort", "must differ from metricsPort"),
        ({"engine": {"url": "localhost:8000"}}, "engine.url", "http(s) URL with a host"),
        ({"engine": {"url": "http:///health"}}, "engine.url", "http(s) URL with a host"),
        ({"engine": {"url": "http://h:70000"}}, "engine.url", "not a valid URL"),
        ({"metrics": {"url": "ftp://prom:9090"}}, "metrics.url", "http(s) URL with a host"),
        ({"engine": {"healthPath": "health"}}, "engine.healthPath", "must start with '/'"),
        ({"metrics": {"promqlSelector": 'pod="x"'}}, "metrics.promqlSelector", "label matcher in braces"),
        ({"predictor": {"external": {"url": "length-predictor:9000"}}}, "predictor.external.url", "http(s) URL"),
        ({"predictor": {"external": {"feedbackUrl": "http://p:9000/completions"}}}, "predictor.external.feedbackUrl",
         "needs url"),
    ],
)
def test_cross_field_rule_names_the_field(doc, path, words):
    [(where, msg)] = problems_of(doc)
    assert where == path
    assert words in msg


def test_rules_allow_their_edge_cases():
    parse_config({"server": {"grpcPort": 0, "metricsPort": 0}})
    parse_config({"metrics": {"intervalMilliseconds": 1500, "staleAfterMilliseconds": 3000}})
    parse_config({"batch": {"minBatchSize": 8, "staticSize": 8, "maxBatchSize": 8}})
    parse_config({"bins": {"count": 1, "boundaries": []}})
    parse_config({"batch": {"sizing": "Sla"}, "latency": {"tpotMilliseconds": 1}})


def test_every_problem_is_listed_one_per_line():
    problems = problems_of(
        {"bins": {"mode": "Auto", "boundaries": [5]}, "server": {"grpcPort": 1, "metricsPort": 1}, "logging": {"level": "Loud"}}
    )
    assert [p for p, _ in problems] == ["bins.boundaries", "server.grpcPort", "logging.level"]


def test_unknown_key_is_rejected_by_name():
    assert problems_of({"batch": {"maxBatchSizee": 10}}) == [("batch.maxBatchSizee", "Extra inputs are not permitted")]
    assert problems_of({"sidecar": {}}) == [("sidecar", "Extra inputs are not permitted")]


@pytest.mark.parametrize(
    ("doc", "path", "msg"),
    [
        ({"batch": {"maxBatchSize": 5000}}, "batch.maxBatchSize", "Input should be less than or equal to 4096"),
        ({"batch": {"staticSize": "32"}}, "batch.staticSize", "Input should be a valid integer"),
        ({"batch": {"staticSize": 32.0}}, "batch.staticSize", "Input should be a valid integer"),
        ({"logging": {"logPrompts": "yes"}}, "logging.logPrompts", "Input should be a valid boolean"),
        ({"logging": {"format": "json"}}, "logging.format", "Input should be 'Json' or 'Text'"),
        ({"bins": {"boundaries": [10, "20", 30]}}, "bins.boundaries[1]", "Input should be a valid integer"),
        ({"bins": {"mode": "fixed"}}, "bins.mode", "Input should be 'Fixed', 'Auto' or 'Adaptive'"),
        ({"batch": None}, "batch", "Input should be a valid dictionary or instance of BatchConfig"),
        ({"predictor": {"external": {"timeoutMilliseconds": 0}}}, "predictor.external.timeoutMilliseconds",
         "Input should be greater than or equal to 1"),
        ({"predictor": {"external": {"timeoutMilliseconds": 10_001}}}, "predictor.external.timeoutMilliseconds",
         "Input should be less than or equal to 10000"),
    ],
)
def test_wrong_type_or_bound_names_the_field(doc, path, msg):
    assert problems_of(doc) == [(path, msg)]


@pytest.mark.parametrize("doc", [[1, 2], "batch", 3])
def test_top_level_must_be_a_mapping(doc):
    assert problems_of(doc) == [("<root>", "expected a mapping")]


def test_load_config_records_source_and_hash(tmp_path):
    path = tmp_path / "sidecar.yaml"
    path.write_text(FULL)
    loaded = load_config(path)
    assert loaded.config == parse_config(yaml.safe_load(FULL))
    assert loaded.sha256 == hashlib.sha256(FULL.encode()).hexdigest()
    assert (loaded.source, loaded.generation) == (str(path), 1)
    assert loaded.loaded_at > 0


@pytest.mark.parametrize("text", ["", "   \n\n  \n", "# rendered by the operator\n", "---\n# nothing\n"])
def test_an_empty_file_is_an_error_not_the_defaults(tmp_path, text):
    path = tmp_path / "sidecar.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    [(where, msg)] = err.value.problems
    assert where == str(path) and "holds no config" in msg


def test_an_empty_mapping_is_the_defaults(tmp_path):
    path = tmp_path / "sidecar.yaml"
    path.write_text("{}\n")
    assert load_config(path).config == SidecarConfig()


def test_classes_map_names_to_priorities():
    cfg = parse_config(yaml.safe_load(FULL))
    assert cfg.classes.priority_of("interactive") == 100
    assert cfg.classes.priority_of("batch") == -100
    assert cfg.classes.priority_of("other") is None
    assert SidecarConfig().classes.classes == []


def test_classes_say_what_their_callers_may_steer_with():
    cfg = parse_config(yaml.safe_load(FULL))
    interactive, batch, default = (cfg.classes.inputs_of(n) for n in ("interactive", "batch", ""))
    assert [interactive.allows(w) for w in CALLER_INPUTS] == [True, True, True]
    assert [batch.allows(w) for w in CALLER_INPUTS] == [False, False, False]
    assert [default.allows(w) for w in CALLER_INPUTS] == [True, False, False]
    assert cfg.classes.inputs_of("other") is None


def test_a_named_class_may_send_hints_only_and_no_class_keeps_everything_by_default():
    named = parse_config({"classes": {"classes": [{"name": "a"}]}}).classes.inputs_of("a")
    assert [named.allows(w) for w in CALLER_INPUTS] == [True, False, False]
    unnamed = SidecarConfig().classes.inputs_of("")
    assert [unnamed.allows(w) for w in CALLER_INPUTS] == [True, True, True]  # a policy without classes as before


@pytest.mark.parametrize(
    ("classes", "path", "words"),
    [
        ({"classes": [{"name": "a", "allowHints": "yes"}]}, "classes.classes[0].allowHints", "valid boolean"),
        ({"default": {"allowPriority": 1}}, "classes.default.allowPriority", "valid boolean"),
        ({"default": {"allowSlo": True}}, "classes.default.allowSlo", "Extra inputs are not permitted"),
    ],
)
def test_bad_allow_keys_name_the_key(classes, path, words):
    [(where, msg)] = problems_of({"classes": classes})
    assert where == path and words in msg


@pytest.mark.parametrize(
    ("classes", "path", "words"),
    [
        ([{"name": "a"}, {"name": "a", "priority": 1}], "classes.classes[1].name", "duplicate class 'a'"),
        ([{"name": "Has Space"}], "classes.classes[0].name", "should match pattern"),
        ([{"name": "a", "priority": 1001}], "classes.classes[0].priority", "less than or equal to 1000"),
        ([{"priority": 1}], "classes.classes[0].name", "Field required"),
    ],
)
def test_bad_classes_name_the_entry(classes, path, words):
    [(where, msg)] = problems_of({"classes": {"classes": classes}})
    assert where == path and words in msg


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "sidecar.yaml"
    path.write_text("batch:\n  staticSize: 8\n  maxWaitMilliseconds: [1,\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    [(where, msg)] = err.value.problems
    assert where == str(path)
    assert msg.startswith("invalid YAML at line 4: ")


def test_missing_file_is_an_os_error(tmp_path):
    with pytest.raises(OSError):
        load_config(tmp_path / "absent.yaml")


def test_the_sidecar_command_refuses_an_empty_config_file_at_start_up(tmp_path, capsys):
    from binbatch_sidecar import cli

    path = tmp_path / "sidecar.yaml"
    path.write_text("# being written\n")
    assert cli.main(["sidecar", "--config", str(path)]) == 2
    assert "holds no config" in capsys.readouterr().err


def test_a_policy_with_classes_renders_a_config_the_sidecar_enforces():
    from binbatch_operator import crd
    from binbatch_operator.builders import sidecar_config

    spec = {"selector": {"matchLabels": {"app": "vllm"}}, "classes": {
        "classes": [{"name": "interactive", "priority": 100, "allowPriority": True}],
        "default": {"allowSloHeaders": False}}}  # fmt: skip
    classes = parse_config(sidecar_config(spec)).classes
    assert classes.priority_of("interactive") == 100
    assert [classes.inputs_of("interactive").allows(w) for w in CALLER_INPUTS] == [True, True, False]
    assert [classes.inputs_of("").allows(w) for w in CALLER_INPUTS] == [True, True, False]
    schema = crd.spec_schema()["properties"]["classes"]["properties"]["classes"]
    assert schema["x-kubernetes-list-type"] == "map" and schema["x-kubernetes-list-map-keys"] == ["name"]
    priority = schema["items"]["properties"]["priority"]
    assert (priority["minimum"], priority["maximum"]) == (-1000, 1000)
    allowed = {k: v["default"] for k, v in schema["items"]["properties"].items() if k.startswith("allow")}
    assert allowed == {"allowHints": True, "allowPriority": False, "allowSloHeaders": False}
    default = crd.spec_schema()["properties"]["classes"]["properties"]["default"]["properties"]
    assert {k: v["default"] for k, v in default.items()} == {"allowHints": True, "allowPriority": True, "allowSloHeaders": True}


def test_count_mode_auto_needs_a_latency_target_and_free_bins():
    with pytest.raises(ConfigError) as err:
        parse_config({"bins": {"countMode": "Auto", "mode": "Adaptive"}})
    assert "bins.latencyTargetMilliseconds: must be > 0 when countMode is Auto" in str(err.value)
    assert "bins.countMode: must be Fixed when mode is Adaptive" in str(err.value)
    with pytest.raises(ConfigError, match="bins.boundaries: must be empty when countMode is Auto"):
        parse_config({"bins": {"countMode": "Auto", "latencyTargetMilliseconds": 500, "count": 2, "boundaries": [64]}})
    cfg = parse_config({"bins": {"countMode": "Auto", "latencyTargetMilliseconds": 500}})
    assert cfg.bins.count_mode == "Auto"


def test_smdp_dispatch_needs_gang_mode():
    with pytest.raises(ConfigError, match="batch.dispatch: Smdp needs mode Gang"):
        parse_config({"batch": {"dispatch": "Smdp"}})
    assert parse_config({"batch": {"dispatch": "Smdp", "mode": "Gang"}}).batch.dispatch == "Smdp"


def test_drain_order_longest_fit_first_needs_the_projected_kv_plan_and_names_what_is_missing():
    ok = parse_config({"memory": {"admission": "Projected"}, "batch": {"drainOrder": "LongestFitFirst"}})
    assert ok.batch.drain_order == "LongestFitFirst"
    assert parse_config({}).batch.drain_order == "ShortestFirst"
    with pytest.raises(ConfigError) as err:
        parse_config({"batch": {"drainOrder": "LongestFitFirst", "order": "Fifo"}, "memory": {"admission": "BatchSize"}})
    assert str(err.value).count("batch.drainOrder") == 1
    assert "memory.admission Projected (is BatchSize)" in str(err.value)
    assert "batch.order ShortestFirst (is Fifo)" in str(err.value)
    with pytest.raises(ConfigError, match=r"batch\.drainOrder"):
        parse_config({"batch": {"drainOrder": "Longest"}})
    # Auto resolves to the plan in continuous mode, so the default admission packs too; Gang does not plan
    assert parse_config({"batch": {"drainOrder": "LongestFitFirst"}}).kv_admission == "Projected"
    with pytest.raises(ConfigError, match=r"memory\.admission Projected \(is Auto, resolving to BatchSize\)"):
        parse_config({"batch": {"drainOrder": "LongestFitFirst", "mode": "Gang"}})


def test_front_door_bounds_default_to_4_mib_requests_256_mib_queued_and_no_extra_passthrough():
    cfg = SidecarConfig()
    assert cfg.server.max_request_bytes == 4 * 1024 * 1024
    assert cfg.batch.max_queued_bytes == 256 * 1024 * 1024
    assert cfg.server.passthrough_paths == []


@pytest.mark.parametrize(
    ("doc", "path", "says"),
    [
        ({"server": {"passthroughPaths": ["/admin/*"]}}, "server.passthroughPaths", "no wildcards"),
        ({"server": {"passthroughPaths": ["tokenize"]}}, "server.passthroughPaths", "absolute path"),
        ({"server": {"passthroughPaths": ["/v1/models?x=1"]}}, "server.passthroughPaths", "no query"),
        ({"server": {"passthroughPaths": ["/a%2Fb"]}}, "server.passthroughPaths", "percent-encoding"),
        ({"server": {"passthroughPaths": ["/v1/../pause"]}}, "server.passthroughPaths", "'..'"),
        ({"server": {"passthroughPaths": ["/x" * 129]}}, "server.passthroughPaths[0]", "256"),
        ({"server": {"passthroughPaths": [f"/p{i}" for i in range(33)]}}, "server.passthroughPaths", "32"),
        ({"server": {"passthroughPaths": ["/tokenize", "/tokenize"]}}, "server.passthroughPaths", "twice"),
        ({"server": {"passthroughPaths": ["/v1/chat/completions"]}}, "server.passthroughPaths", "own route"),
        ({"server": {"passthroughPaths": "/tokenize"}}, "server.passthroughPaths", "list"),
        ({"server": {"maxRequestBytes": 1024}}, "server.maxRequestBytes", "65536"),
        ({"server": {"maxRequestBytes": 2**27}}, "server.maxRequestBytes", "67108864"),
        ({"server": {"httpRequestReadTimeoutMilliseconds": 50}}, "server.httpRequestReadTimeoutMilliseconds", "100"),
        ({"server": {"httpRequestReadTimeoutMilliseconds": 600_001}}, "server.httpRequestReadTimeoutMilliseconds", "600000"),
        ({"server": {"httpRequestReadTimeoutMilliseconds": "30s"}}, "server.httpRequestReadTimeoutMilliseconds", "integer"),
        ({"server": {"maxConnections": 0}}, "server.maxConnections", "1"),
        ({"server": {"maxConnections": 1.5}}, "server.maxConnections", "integer"),
        ({"server": {"grpcMaxConcurrentStreams": -1}}, "server.grpcMaxConcurrentStreams", "0"),
        ({"server": {"grpcMaxConcurrentStreams": 65_537}}, "server.grpcMaxConcurrentStreams", "65536"),
        ({"server": {"grpcMaxConnectionAgeSeconds": 9}}, "server.grpcMaxConnectionAgeSeconds", "10"),
        ({"server": {"grpcMaxConnectionAgeSeconds": 86_401}}, "server.grpcMaxConnectionAgeSeconds", "86400"),
        ({"server": {"maxConnection": 10}}, "server.maxConnection", "Extra inputs"),
        ({"batch": {"maxQueuedBytes": 1000}}, "batch.maxQueuedBytes", "1048576"),
        ({"batch": {"maxQueuedBytes": 2**37}}, "batch.maxQueuedBytes", "68719476736"),
        ({"batch": {"maxQueuedBytes": 2 * 1024 * 1024}}, "batch.maxQueuedBytes", "server.maxRequestBytes"),
    ],
)
def test_front_door_settings_refused_name_their_field(doc, path, says):
    with pytest.raises(ConfigError) as err:
        parse_config(doc)
    assert [p for p, _ in err.value.problems] == [path]
    assert says in err.value.problems[0][1]


def test_connection_settings_default_to_30_s_reads_1024_connections_no_stream_cap_and_30_minute_grpc_connections():
    server = SidecarConfig().server
    assert server.http_request_read_timeout_milliseconds == 30_000 and server.max_connections == 1024
    assert (server.grpc_max_concurrent_streams, server.grpc_max_connection_age_seconds) == (0, 1800)


def test_connection_settings_bound_at_start_up_need_a_restart_and_max_connections_does_not():
    running = SidecarConfig()
    changed = parse_config({"server": {"httpRequestReadTimeoutMilliseconds": 5000, "grpcMaxConcurrentStreams": 8,
                                       "grpcMaxConnectionAgeSeconds": 60}})  # fmt: skip
    assert [p for p, _ in restart_required(running, changed)] == [
        "server.httpRequestReadTimeoutMilliseconds", "server.grpcMaxConcurrentStreams", "server.grpcMaxConnectionAgeSeconds",
    ]  # fmt: skip
    assert restart_required(running, parse_config({"server": {"maxConnections": 8}})) == []


def test_max_request_bytes_needs_a_restart_and_passthrough_paths_do_not():
    running = SidecarConfig()
    bigger = parse_config({"server": {"maxRequestBytes": 8 * 1024 * 1024}})
    assert [p for p, _ in restart_required(running, bigger)] == ["server.maxRequestBytes"]
    assert restart_required(running, parse_config({"server": {"passthroughPaths": ["/tokenize"]}})) == []


@pytest.mark.parametrize(
    ("tenants", "path", "words"),
    [
        ({"tenants": [{"name": "a"}, {"name": "a", "weight": 2}]}, "tenants.tenants[1].name", "duplicate tenant 'a'"),
        ({"tenants": [{"name": "_other"}]}, "tenants.tenants[0].name", "should match pattern"),
        ({"tenants": [{"name": " a"}]}, "tenants.tenants[0].name", "should match pattern"),
        ({"tenants": [{"name": "caf\u00e9"}]}, "tenants.tenants[0].name", "should match pattern"),
        ({"tenants": [{"name": "x" * 257}]}, "tenants.tenants[0].name", "at most 256 characters"),
        ({"tenants": [{"name": "a", "weight": 1001}]}, "tenants.tenants[0].weight", "less than or equal to 1000"),
        ({"tenants": [{"name": "a", "weight": 0}]}, "tenants.tenants[0].weight", "greater than or equal to 1"),
        ({"tenants": [{"name": "a", "weight": 1.5}]}, "tenants.tenants[0].weight", "valid integer"),
        ({"tenants": [{"weight": 2}]}, "tenants.tenants[0].name", "Field required"),
        ({"defaultWeight": 0}, "tenants.defaultWeight", "greater than or equal to 1"),
        ({"maxQueuedSharePercent": 101}, "tenants.maxQueuedSharePercent", "less than or equal to 100"),
        ({"weights": {}}, "tenants.weights", "Extra inputs are not permitted"),
    ],
)
def test_bad_tenants_name_the_field(tenants, path, words):
    with pytest.raises(ConfigError) as err:
        parse_config({"tenants": tenants})
    assert err.value.problems[0][0] == path and words in err.value.problems[0][1]


def test_tenants_weights_reach_the_scheduler_core():
    from binbatch_sidecar.core.clock import ManualClock
    from binbatch_sidecar.server.assembly import build_core

    cfg = parse_config(yaml.safe_load(FULL))
    core = build_core(cfg, ManualClock())
    assert core.tenants.weight("team-a") == 3 and core.tenants.weight("llm-d flow/7") == 1
    assert core.tenants.weight("someone") == 2 and core.tenants.floor_percent == 25
    assert core.max_queued_requests == cfg.batch.max_queued_requests


def test_a_policy_with_tenants_renders_a_config_the_sidecar_enforces():
    from binbatch_operator import crd
    from binbatch_operator.builders import sidecar_config

    spec = {"selector": {"matchLabels": {"app": "vllm"}},
            "tenants": {"tenants": [{"name": "team-a", "weight": 5}], "maxQueuedSharePercent": 20}}  # fmt: skip
    tenants = parse_config(sidecar_config(spec)).tenants
    assert tenants.weights() == {"team-a": 5} and tenants.default_weight == 1
    assert tenants.max_queued_share_percent == 20
    schema = crd.spec_schema()["properties"]["tenants"]["properties"]
    assert schema["tenants"]["x-kubernetes-list-map-keys"] == ["name"] and schema["tenants"]["maxItems"] == 256
    name, weight = schema["tenants"]["items"]["properties"]["name"], schema["tenants"]["items"]["properties"]["weight"]
    assert name["maxLength"] == 256 and name["pattern"].startswith("^[!-^`-~]")
    assert (weight["minimum"], weight["maximum"], weight["type"]) == (1, 1000, "integer")
