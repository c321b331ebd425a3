"""Config reload on a running sidecar: every key is applied live or refused.

Issue 9 defect 2: a reloaded ``engine.url`` showed in GetConfig while traffic
stayed on the old engine; the ports, ``logging.level``, the poll interval and
``logging.logPrompts`` were shown but not applied either.  The table below goes
through EVERY key of the config schema (a test fails when a key is added without
a row): a reload changing it is either applied (the running value is asserted)
or refused with a message that says a restart is needed.  Nothing sleeps: each
reload is one ``watcher.check()``.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import shutil
import tempfile
import typing
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from prometheus_client.parser import text_string_to_metric_families
from sidecar_harness import prompt_request, running_sidecar, sidecar_config

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_sidecar.config import CALLER_INPUTS, SidecarConfig
from binbatch_sidecar.core import length_model
from binbatch_sidecar.core.binner import FixedBinner
from binbatch_sidecar.core.request import Request
from binbatch_sidecar.emulator import EmulatorConfig, running_emulator
from binbatch_sidecar.engine.model_file import save_model
from binbatch_sidecar.server import logs
from binbatch_sidecar.server.app import Sidecar

FAST = EmulatorConfig(step_a=0.001, step_c=0.0001, num_gpu_blocks=512, block_size=16)
OTHER = "http://127.0.0.1:9"  # a second engine URL; rows that need it to answer use a second emulator
WARM_START = os.path.join(tempfile.gettempdir(), f"binbatch-reload-warm-{os.getpid()}.npz")  # written by warm_start()
KEY_FILE = os.path.join(tempfile.gettempdir(), f"binbatch-reload-key-{os.getpid()}")  # written by key_file()
TOKENS_DIR = os.path.join(tempfile.gettempdir(), f"binbatch-reload-tokens-{os.getpid()}")  # written by auth_files()
ADMIN_FILE = os.path.join(tempfile.gettempdir(), f"binbatch-reload-admin-{os.getpid()}")  # written by auth_files()
OPERATOR_KEY = Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo).decode()
NO_MODEL = os.path.join(tempfile.gettempdir(), f"binbatch-reload-none-{os.getpid()}.npz")  # never written


@pytest.fixture
def root_level():
    """logging.level is applied to the root logger, logging.format to the log
    output: give the test process its level and format back."""
    root = logging.getLogger()
    saved = root.level, logs.current_format()
    yield
    root.setLevel(saved[0])
    logs.set_format(saved[1])


@pytest.fixture
def warm_start():
    """A small model at WARM_START (fitted on 20 records), for the predictor.warmStart row."""
    prompts = [f"{'write a long essay' if i % 2 else 'yes or no'} about thing {i}" for i in range(20)]
    save_model(WARM_START, length_model.fit([length_model.featurize(p) for p in prompts],
                                            [400.0 if i % 2 else 3.0 for i in range(20)]))  # fmt: skip
    yield WARM_START
    os.unlink(WARM_START)


@pytest.fixture
def auth_files():
    """A callers' token directory (one caller, team-a) and an admin token, for the auth rows."""
    os.makedirs(TOKENS_DIR, exist_ok=True)
    with open(os.path.join(TOKENS_DIR, "team-a"), "w", encoding="utf-8") as f:
        f.write("reload-caller-token\n")
    with open(ADMIN_FILE, "w", encoding="utf-8") as f:
        f.write("reload-admin-token\n")
    yield
    shutil.rmtree(TOKENS_DIR)
    os.unlink(ADMIN_FILE)


@pytest.fixture
def key_file():
    """An engine API key at KEY_FILE, for the engine.apiKeyFile row."""
    with open(KEY_FILE, "w", encoding="utf-8") as f:
        f.write("reload-row-key\n")
    yield KEY_FILE
    os.unlink(KEY_FILE)


def _core(sc: Sidecar):
    return sc.dispatcher.core


async def _health_after_check(sc: Sidecar) -> bool:
    await sc._check_engine()
    return sc.engine_serving


Probe = Callable[[Sidecar], Any]

# (section, key): (change, probe, expected). ``change`` is merged into the sections
# of the base document; ``probe`` reads the value the sidecar RUNS with (the object
# that uses it), or - for keys read from the config at each use - the lookup that
# use does. None instead of a row: a key the sidecar cannot change live (refused).
APPLIED: dict[tuple[str, str], tuple[dict[str, dict[str, Any]], Probe, Any]] = {
    ("engine", "url"): ({"engine": {"url": OTHER}}, lambda s: (s.client.base_url, s.dispatcher.client.base_url), (OTHER, OTHER)),  # fmt: skip
    ("engine", "model"): ({"engine": {"model": "m2"}}, lambda s: s.default_model(), "m2"),
    ("engine", "request_timeout_seconds"): (
        {"engine": {"requestTimeoutSeconds": 77}}, lambda s: (s.dispatcher.engine_timeout, s.client.timeout_seconds), (77, 77.0),
    ),  # fmt: skip
    ("engine", "health_path"): ({"engine": {"healthPath": "/nope"}}, _health_after_check, False),
    ("engine", "max_request_body_bytes"): (
        {"engine": {"maxRequestBodyBytes": 4096}}, lambda s: (s.client.max_body_bytes, s.dispatcher.client.max_body_bytes), (4096, 4096),
    ),  # fmt: skip
    ("engine", "api_key_file"): (  # one key object shared by the client and the scrape; see test_engine_key
        {"engine": {"apiKeyFile": KEY_FILE}}, lambda s: (s.client.api_key.headers(), s.client.api_key is s.engine_key),
        ({"Authorization": "Bearer reload-row-key"}, True),
    ),  # fmt: skip
    ("bins", "mode"): ({"bins": {"mode": "Auto"}}, lambda s: type(_core(s).binner).__name__, "AutoBinner"),
    ("bins", "count"): ({"bins": {"count": 6}}, lambda s: _core(s).binner.k, 6),
    ("bins", "count_mode"): (
        {"bins": {"countMode": "Auto", "latencyTargetMilliseconds": 900}}, lambda s: s.bin_count.latency_target, 0.9,
    ),  # fmt: skip
    ("bins", "latency_target_milliseconds"): (
        {"bins": {"countMode": "Auto", "latencyTargetMilliseconds": 700}}, lambda s: s.bin_count.latency_target, 0.7,
    ),  # fmt: skip
    ("bins", "boundaries"): ({"bins": {"boundaries": [10, 100, 1000]}}, lambda s: list(_core(s).binner.boundaries), [10, 100, 1000]),  # fmt: skip
    ("bins", "max_output_tokens"): (
        {"bins": {"maxOutputTokens": 1000}}, lambda s: list(_core(s).binner.boundaries),
        list(FixedBinner.uniform(4, 1, 1000).boundaries),
    ),  # fmt: skip
    ("bins", "auto_window"): ({"bins": {"mode": "Auto", "autoWindow": 100}}, lambda s: _core(s).binner._window.maxlen, 100),  # fmt: skip
    ("bins", "auto_refresh_every"): ({"bins": {"mode": "Auto", "autoRefreshEvery": 7}}, lambda s: _core(s).binner._refresh_every, 7),  # fmt: skip
    ("bins", "split_threshold_percent"): (
        {"bins": {"mode": "Adaptive", "splitThresholdPercent": 70}}, lambda s: _core(s).binner.theta, 0.7,
    ),  # fmt: skip
    ("bins", "max_requests_per_bin"): (
        {"bins": {"mode": "Adaptive", "maxRequestsPerBin": 99}}, lambda s: _core(s).binner.n_max, 99,
    ),  # fmt: skip
    ("batch", "mode"): ({"batch": {"mode": "Gang"}}, lambda s: s.dispatcher.mode, "gang"),
    ("batch", "sizing"): ({"batch": {"sizing": "Static"}}, lambda s: _core(s).sizer.mode, "static"),
    ("batch", "static_size"): ({"batch": {"staticSize": 16}}, lambda s: _core(s).sizer.static_size, 16),
    ("batch", "min_batch_size"): ({"batch": {"minBatchSize": 2}}, lambda s: _core(s).sizer.min_size, 2),
    ("batch", "max_batch_size"): ({"batch": {"maxBatchSize": 100}}, lambda s: _core(s).sizer.max_size, 100),
    ("batch", "max_wait_milliseconds"): ({"batch": {"maxWaitMilliseconds": 250}}, lambda s: _core(s).former._max_wait, 0.25),  # fmt: skip
    ("batch", "max_inflight_batches"): ({"batch": {"maxInflightBatches": 7}}, lambda s: s.dispatcher.max_inflight_batches, 7),  # fmt: skip
    ("batch", "dispatch"): (
        {"batch": {"mode": "Gang", "dispatch": "Smdp"}}, lambda s: _core(s).former._policy is s.smdp is not None, True,
    ),  # fmt: skip
    ("batch", "smdp_engine_weight"): (
        {"batch": {"mode": "Gang", "dispatch": "Smdp", "smdpEngineWeight": 5}}, lambda s: s.smdp.cache.params.w2, 5.0,
    ),  # fmt: skip
    ("batch", "max_queued_requests"): ({"batch": {"maxQueuedRequests": 55}}, lambda s: _core(s).former._max_queue, 55),  # fmt: skip
    ("batch", "order"): ({"batch": {"order": "Fifo"}}, lambda s: _core(s).admission.order, "fifo"),
    ("batch", "max_queued_bytes"): ({"batch": {"maxQueuedBytes": 8 << 20}}, lambda s: _core(s).max_queued_bytes, 8 << 20),  # fmt: skip
    ("batch", "aging"): ({"batch": {"aging": "Fixed"}}, lambda s: _core(s).admission.aging, 20.0),
    ("batch", "aging_tokens_per_second"): (
        {"batch": {"aging": "Fixed", "agingTokensPerSecond": 7}}, lambda s: _core(s).admission.aging, 7.0,
    ),  # fmt: skip
    ("batch", "max_queue_wait_milliseconds"): ({"batch": {"maxQueueWaitMilliseconds": 1500}}, lambda s: _core(s).admission.max_wait, 1.5),  # fmt: skip
    ("batch", "follow_engine_queue"): ({"batch": {"followEngineQueue": False}}, lambda s: _core(s).admission.follow_engine, False),  # fmt: skip
    ("batch", "drain_order"): (
        {"memory": {"admission": "Projected"}, "batch": {"drainOrder": "LongestFitFirst"}},
        lambda s: _core(s).admission.drain, "longest_fit_first",
    ),  # fmt: skip
    ("batch", "shortest_by"): (
        {"memory": {"admission": "Projected"}, "batch": {"shortestBy": "KvFootprint"}},
        lambda s: _core(s).admission.by_footprint, True,
    ),  # fmt: skip
    ("memory", "admission"): ({"memory": {"admission": "Projected"}}, lambda s: _core(s).kv_plan is not None, True),
    ("memory", "overflow_per_mille"): ({"memory": {"overflowPerMille": 20}}, lambda s: _core(s).sizer.eps_m, 0.02),
    ("memory", "kv_reserve_percent"): ({"memory": {"kvReservePercent": 10}}, lambda s: _core(s).sizer.kv_reserve_ratio, 0.1),  # fmt: skip
    ("memory", "kv_saturation_percent"): ({"memory": {"kvSaturationPercent": 80}}, lambda s: _core(s).sizer.kv_saturation, 0.8),  # fmt: skip
    ("latency", "tpot_milliseconds"): ({"latency": {"tpotMilliseconds": 50}}, lambda s: _core(s).sizer.sla.d_sla, 0.05),
    ("latency", "ttft_milliseconds"): ({"latency": {"ttftMilliseconds": 2000}}, lambda s: s.config.queue_budget_seconds(None), 1.0),  # fmt: skip
    ("latency", "queue_share_percent"): ({"latency": {"queueSharePercent": 25}}, lambda s: s.config.queue_budget_seconds(1000), 0.25),  # fmt: skip
    ("latency", "tolerance_percent"): (
        {"latency": {"tpotMilliseconds": 50, "tolerancePercent": 20}}, lambda s: round(_core(s).sizer.sla.eps_d, 6), 0.01,
    ),  # fmt: skip
    ("predictor", "kind"): ({"predictor": {"kind": "Hint"}}, lambda s: _core(s).predictor.name, "hint"),
    ("predictor", "default_output_tokens"): (
        {"predictor": {"defaultOutputTokens": 99}}, lambda s: _core(s).predictor.predict(Request(id="p", arrival=0.0)), 99.0,
    ),  # fmt: skip
    ("predictor", "external"): (  # the core asks the service's answer first; its client reads the keys per call
        {"predictor": {"external": {"url": OTHER + "/predict", "timeoutMilliseconds": 77, "breakerOpenMilliseconds": 900,
                                    "feedbackUrl": OTHER + "/completions"}}},
        lambda s: (type(_core(s).predictor).__name__, s.external.enabled, s.external.config().timeout_milliseconds,
                   s.external.config().breaker_open_milliseconds, s.external.config().feedback_url),
        ("ExternalFirst", True, 77, 900, OTHER + "/completions"),
    ),  # fmt: skip
    ("predictor", "warm_start"): (
        {"predictor": {"kind": "Learned", "warmStart": WARM_START}}, lambda s: _core(s).predictor.model.records, 20,
    ),  # fmt: skip
    ("predictor", "warm_start_optional"): (  # a missing file is no error then: a cold Learned predictor
        {"predictor": {"kind": "Learned", "warmStart": NO_MODEL, "warmStartOptional": True}},
        lambda s: (_core(s).predictor.warm_start, _core(s).predictor.model), (NO_MODEL, None),
    ),  # fmt: skip
    ("predictor", "refit_every_records"): (
        {"predictor": {"kind": "Learned", "refitEveryRecords": 64}}, lambda s: _core(s).predictor.refit_every, 64,
    ),  # fmt: skip
    ("predictor", "training_buffer_records"): (
        {"predictor": {"kind": "Learned", "trainingBufferRecords": 128}}, lambda s: _core(s).predictor._records.maxlen, 128,
    ),  # fmt: skip
    ("metrics", "source"): ({"metrics": {"source": "None"}}, lambda s: s.feed.source, None),
    ("metrics", "url"): ({"metrics": {"url": OTHER + "/metrics"}}, lambda s: s.feed.source.url, OTHER + "/metrics"),
    ("metrics", "interval_milliseconds"): ({"metrics": {"intervalMilliseconds": 200}}, lambda s: s.feed.interval, 0.2),
    ("metrics", "stale_after_milliseconds"): ({"metrics": {"staleAfterMilliseconds": 5000}}, lambda s: s.feed.stale_after, 5.0),  # fmt: skip
    ("metrics", "promql_selector"): (
        {"metrics": {"source": "PromQL", "url": OTHER, "promqlSelector": '{pod="x"}'}}, lambda s: s.feed.source.selector, '{pod="x"}',
    ),  # fmt: skip
    ("server", "drain_grace_seconds"): ({"server": {"drainGraceSeconds": 3}}, lambda s: s.config.server.drain_grace_seconds, 3),  # read by stop()  # fmt: skip
    ("server", "config_poll_milliseconds"): ({"server": {"configPollMilliseconds": 250}}, lambda s: s.watcher.poll_seconds, 0.25),  # fmt: skip
    ("server", "passthrough_paths"): ({"server": {"passthroughPaths": ["/tokenize"]}}, lambda s: s.config.server.passthrough_paths, ["/tokenize"]),  # read per request; see test_front_door_intake  # fmt: skip
    ("server", "max_connections"): ({"server": {"maxConnections": 7}}, lambda s: s.config.server.max_connections, 7),  # read per connection; see test_slow_connections  # fmt: skip
    ("logging", "level"): ({"logging": {"level": "Debug"}}, lambda s: logging.getLogger().level, logging.DEBUG),
    ("logging", "format"): ({"logging": {"format": "Text"}}, lambda s: logs.current_format(), "Text"),  # and see test_sidecar_process  # fmt: skip
    ("logging", "log_prompts"): ({"logging": {"logPrompts": True}}, lambda s: s.config.logging.log_prompts, True),  # read per request; see test_sidecar_input  # fmt: skip
    ("classes", "classes"): (
        {"classes": {"classes": [{"name": "x", "priority": 5, "allowHints": False, "allowPriority": True,
                                  "allowSloHeaders": True}]}},
        lambda s: (s.config.classes.priority_of("x"), [s.config.classes.inputs_of("x").allows(w) for w in CALLER_INPUTS]),
        (5, [False, True, True]),
    ),  # read per request; see test_caller_inputs  # fmt: skip
    ("classes", "default"): (
        {"classes": {"default": {"allowHints": False, "allowPriority": False, "allowSloHeaders": False}}},
        lambda s: [s.config.classes.inputs_of("").allows(w) for w in CALLER_INPUTS], [False, False, False],
    ),  # read per request; see test_caller_inputs  # fmt: skip
    # the scheduler reads the weights at each admission and refusal (test_fair_share); the metrics' labels too
    ("tenants", "tenants"): (
        {"tenants": {"tenants": [{"name": "team-x", "weight": 7}]}},
        lambda s: (s.dispatcher.scheduler._weight("team-x"), s.metrics.tenant_label("team-x")), (7, "team-x"),
    ),  # fmt: skip
    ("tenants", "default_weight"): (
        {"tenants": {"defaultWeight": 4}}, lambda s: s.dispatcher.scheduler._weight("anyone"), 4,
    ),  # fmt: skip
    ("tenants", "max_queued_share_percent"): (
        {"tenants": {"maxQueuedSharePercent": 30}}, lambda s: _core(s).tenants.floor_percent, 30,
    ),  # fmt: skip
    # read per request and per Admin call (test_caller_auth, test_caller_auth_doors); the files are re-read on change
    ("auth", "caller_tokens_dir"): (
        {"auth": {"callerTokensDir": TOKENS_DIR}},
        lambda s: (s.caller_auth.on, s.caller_tokens.caller("reload-caller-token"), s.caller_tokens.caller("nope")),
        (True, "team-a", None),
    ),  # fmt: skip
    ("auth", "callers"): (
        {"auth": {"callers": [{"name": "team-a", "allowHints": False, "allowPriority": True, "allowSloHeaders": True}]}},
        lambda s: [s.config.auth.inputs_of("team-a").allows(w) for w in CALLER_INPUTS], [False, True, True],
    ),  # fmt: skip
    ("auth", "admin_token_file"): (
        {"auth": {"adminTokenFile": ADMIN_FILE}}, lambda s: s.admin_token.headers(),
        {"Authorization": "Bearer reload-admin-token"},
    ),  # fmt: skip
    ("auth", "operator_public_keys"): (
        {"auth": {"operatorPublicKeys": [OPERATOR_KEY], "audience": "llm/chat"}},
        lambda s: s.admin_gate.config().auth.operator_public_keys, [OPERATOR_KEY],
    ),  # fmt: skip
    ("auth", "audience"): ({"auth": {"audience": "llm/other"}}, lambda s: s.admin_gate.config().auth.audience, "llm/other"),
}
REFUSED: dict[tuple[str, str], dict[str, dict[str, Any]]] = {
    ("server", "grpc_port"): {"server": {"grpcPort": 12345}},
    ("server", "metrics_port"): {"server": {"metricsPort": 12346}},
    ("server", "http_port"): {"server": {"httpPort": 12347}},
    ("server", "max_request_bytes"): {"server": {"maxRequestBytes": 1 << 20}},
    ("server", "http_request_read_timeout_milliseconds"): {"server": {"httpRequestReadTimeoutMilliseconds": 5000}},
    ("server", "grpc_max_concurrent_streams"): {"server": {"grpcMaxConcurrentStreams": 8}},
    ("server", "grpc_max_connection_age_seconds"): {"server": {"grpcMaxConnectionAgeSeconds": 60}},
}
SINGLE_VALUED: dict[tuple[str, str], Any] = {}  # keys with nothing to change them to


def test_the_table_covers_every_config_key():
    keys = {
        (section, key)
        for section, info in SidecarConfig.model_fields.items()
        for key in info.annotation.model_fields  # type: ignore[union-attr]
    }
    assert set(APPLIED) | set(REFUSED) | set(SINGLE_VALUED) == keys
    assert not set(APPLIED) & set(REFUSED)
    for literal in SINGLE_VALUED.values():
        assert len(typing.get_args(literal)) == 1


def _merged(base: dict[str, Any], change: dict[str, dict[str, Any]]) -> dict[str, Any]:
    doc = json.loads(json.dumps(base))
    for section, values in change.items():
        doc.setdefault(section, {}).update(values)
    return doc


async def test_every_key_is_applied_live_or_refused_as_needing_a_restart(tmp_path, root_level, warm_start, key_file,
                                                                         auth_files):
    async with running_emulator(FAST) as url:
        base = sidecar_config(url)
        async with running_sidecar(base, tmp_path) as sc:
            side = sc.sidecar
            for (section, key), (change, probe, expected) in APPLIED.items():
                sc.write_config(_merged(base, change))
                assert await side.watcher.check(), (section, key, side.watcher.last_error)
                got = probe(side)
                if inspect.isawaitable(got):
                    got = await got
                assert got == expected, (section, key)
                view = await sc.admin.GetConfig(pb.GetConfigRequest())
                shown = json.loads(view.config_json)
                for sec, values in change.items():
                    for k, v in values.items():
                        assert shown[sec][k] == v, (sec, k)
                assert view.last_reload_error == ""
                sc.write_config(base)
                assert await side.watcher.check(), (section, key, side.watcher.last_error)
            running = (side.grpc_port, side.metrics_port)
            for (section, key), change in REFUSED.items():
                before = await sc.admin.GetConfig(pb.GetConfigRequest())
                sc.write_config(_merged(base, change))
                assert not await side.watcher.check(), (section, key)
                view = await sc.admin.GetConfig(pb.GetConfigRequest())
                assert (view.generation, view.config_json) == (before.generation, before.config_json)
                [(field, value)] = change[section].items()
                assert f"{section}.{field}" in view.last_reload_error
                assert "needs a restart" in view.last_reload_error
                assert (side.grpc_port, side.metrics_port) == running
                resp = await sc.inference.Generate(prompt_request(1, 3), timeout=30)  # still serving
                assert resp.completion_tokens == 3
                sc.write_config(base)
                assert not await side.watcher.check()  # the running file again: nothing to apply
                assert side.watcher.last_error is None


async def _served(url: str) -> float:
    """Requests the engine (an emulator) finished, from its own /metrics."""
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        text = await resp.text()
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:request_success":
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    raise AssertionError("the emulator exports no vllm:request_success")


async def test_a_new_engine_url_takes_new_traffic_while_running_calls_finish_on_the_old(tmp_path):
    slow = EmulatorConfig(step_a=0.005, step_c=0.0001, num_gpu_blocks=512, block_size=16)
    async with running_emulator(slow) as old_url, running_emulator(FAST) as new_url:
        doc = sidecar_config(old_url)
        async with running_sidecar(doc, tmp_path) as sc:
            side = sc.sidecar
            old_client = side.client
            stream = sc.inference.GenerateStream(prompt_request(1, 200), timeout=60)
            first = await stream.read()  # the request is running in the old engine now
            assert first.text
            doc["engine"]["url"] = new_url
            sc.write_config(doc)
            assert await side.watcher.check()
            assert side.dispatcher.client is side.client is not old_client
            chunk = first
            while not chunk.HasField("final"):
                chunk = await stream.read()
            assert chunk.final.completion_tokens == 200  # finished on the old engine
            resp = await sc.inference.Generate(prompt_request(2, 3), timeout=30)
            assert resp.completion_tokens == 3
            assert (await _served(old_url), await _served(new_url)) == (1, 1)
            await asyncio.gather(*side._background)  # retiring the old client ends when its calls have
            assert old_client._session is None  # closed


async def test_a_reload_is_logged_once(tmp_path, caplog):
    async with running_emulator(FAST) as url:
        doc = sidecar_config(url)
        async with running_sidecar(doc, tmp_path) as sc:
            caplog.set_level(logging.INFO, logger="binbatch")
            doc["batch"] = {"staticSize": 16}
            sc.write_config(doc)
            assert await sc.sidecar.watcher.check()
            applied = [r for r in caplog.records if "applied" in r.getMessage()]
            assert len(applied) == 1, [r.getMessage() for r in applied]
            assert "generation 2" in applied[0].getMessage()


async def test_a_warm_start_that_is_no_model_is_refused_and_the_running_config_kept(tmp_path):
    async with running_emulator(FAST) as url:
        base = sidecar_config(url)
        async with running_sidecar(base, tmp_path) as sc:
            before = await sc.admin.GetConfig(pb.GetConfigRequest())
            running = _core(sc.sidecar).predictor
            sc.write_config(_merged(base, {"predictor": {"kind": "Learned", "warmStart": str(tmp_path / "none.npz")}}))
            assert not await sc.sidecar.watcher.check()
            view = await sc.admin.GetConfig(pb.GetConfigRequest())
            assert (view.generation, view.config_json) == (before.generation, before.config_json)
            assert "predictor.warmStart: cannot read" in view.last_reload_error
            assert _core(sc.sidecar).predictor is running and running.warm_start == ""
