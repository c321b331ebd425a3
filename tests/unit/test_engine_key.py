"""engine.apiKeyFile: the key is read from its file, refused clearly when it cannot
be, re-read when the file changes, and never shown (errors, repr, GetConfig)."""

from __future__ import annotations

import json
import logging

import pytest

from binbatch_sidecar.config import ConfigError, LoadedConfig, config_json, parse_config
from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.engine.engine_client import EngineClient, _http_error
from binbatch_sidecar.engine.engine_key import FIELD, EngineKey, read_api_key
from binbatch_sidecar.server.assembly import metrics_source, same_origin
from binbatch_sidecar.server.openai_http import status_of
from binbatch_sidecar.server.servicer import _status_of

KEY = "sk-test-0123456789abcdef"


def test_the_key_is_the_files_contents_without_surrounding_whitespace(tmp_path):
    path = tmp_path / "api-key"
    path.write_text(f"  {KEY}\n\n")
    assert read_api_key(str(path)) == KEY


@pytest.mark.parametrize(
    ("contents", "says"),
    [
        (b"", "is empty"),
        (b" \n\t\n", "is empty"),
        (f"{KEY} second-half".encode(), "space or control character"),
        (f"{KEY}\x07".encode(), "space or control character"),
        (f"{KEY}é".encode(), "non-ASCII"),
    ],
)
def test_a_key_file_that_holds_no_usable_key_is_refused_naming_the_field(tmp_path, contents, says):
    path = tmp_path / "api-key"
    path.write_bytes(contents)
    with pytest.raises(ConfigError) as err:
        read_api_key(str(path))
    [(field, message)] = err.value.problems
    assert field == FIELD == "engine.apiKeyFile"
    assert says in message and str(path) in message
    assert KEY not in str(err.value) and "second-half" not in str(err.value)


def test_a_key_file_that_cannot_be_read_is_a_config_error_not_a_crash(tmp_path):
    missing = tmp_path / "nowhere" / "api-key"
    with pytest.raises(ConfigError) as err:
        read_api_key(str(missing))
    assert err.value.problems == [(FIELD, f"cannot read the key file {missing}: No such file or directory")]
    with pytest.raises(ConfigError, match="engine.apiKeyFile: cannot read the key file .*: Is a directory"):
        read_api_key(str(tmp_path))


def test_a_whitespace_path_is_refused_by_the_schema():
    with pytest.raises(ConfigError) as err:
        parse_config({"engine": {"apiKeyFile": "   "}})
    assert err.value.problems[0][0] == "engine.apiKeyFile"


def test_the_config_shows_the_path_never_the_key(tmp_path):
    path = tmp_path / "api-key"
    path.write_text(KEY)
    cfg = parse_config({"engine": {"apiKeyFile": str(path)}})
    shown = json.loads(config_json(cfg))
    assert shown["engine"]["apiKeyFile"] == str(path)
    assert KEY not in config_json(cfg)


def test_get_config_returns_the_path_and_never_the_key(tmp_path):
    """The Admin GetConfig reply, built by the same ``Replies`` the servicer uses, with the key loaded."""
    from binbatch_sidecar.engine.dispatcher import Dispatcher
    from binbatch_sidecar.engine.metrics_feed import MetricsFeed
    from binbatch_sidecar.engine.sidecar_metrics import SidecarMetrics
    from binbatch_sidecar.server.assembly import build_core
    from binbatch_sidecar.server.replies import Replies

    path = tmp_path / "api-key"
    path.write_text(KEY)
    cfg = parse_config({"engine": {"apiKeyFile": str(path)}})
    loaded = LoadedConfig(cfg, sha256="0" * 64, source="sidecar.yaml")
    key = EngineKey()
    key.load(cfg.engine.api_key_file)
    clock = ManualClock()
    client = EngineClient(cfg.engine.url, api_key=key)
    dispatcher = Dispatcher(build_core(cfg, clock), client, clock, SidecarMetrics())
    feed = MetricsFeed(metrics_source(cfg, key), interval=1.0, stale_after=3.0, clock=clock, on_snapshot=lambda _: None)
    replies = Replies(dispatcher, feed, clock, loaded=lambda: loaded, engine_serving=lambda: True)
    view = replies.config_view()
    assert json.loads(view.config_json)["engine"]["apiKeyFile"] == str(path)
    assert KEY not in str(view) and KEY not in str(replies.stats())
    assert key.headers() == {"Authorization": f"Bearer {KEY}"}  # loaded, and still not shown


def test_the_holder_never_shows_its_key():
    key = EngineKey("/keys/api-key", KEY)
    assert KEY not in repr(key) and KEY not in str(key)
    assert "/keys/api-key" in repr(key)
    assert EngineKey().headers() == {}


def test_refresh_picks_up_a_rotated_key_and_keeps_the_old_one_while_the_file_is_unreadable(tmp_path, caplog):
    path = tmp_path / "api-key"
    path.write_text("first-key")
    key = EngineKey()
    key.load(str(path))
    assert not key.refresh()  # unchanged
    path.write_text("second-key\n")
    assert key.refresh()
    assert key.headers() == {"Authorization": "Bearer second-key"}
    path.unlink()  # a Secret mid-swap, or removed
    with caplog.at_level(logging.WARNING, logger="binbatch.config"):
        assert not key.refresh()
        assert not key.refresh()
    assert key.headers() == {"Authorization": "Bearer second-key"}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "engine.apiKeyFile" in warnings[0]  # said once, not every poll
    assert "second-key" not in caplog.text


def test_load_of_a_bad_file_keeps_the_key_in_use(tmp_path):
    good, empty = tmp_path / "good", tmp_path / "empty"
    good.write_text("good-key")
    empty.write_text("")
    key = EngineKey()
    key.load(str(good))
    with pytest.raises(ConfigError):
        key.load(str(empty))
    assert (key.path, key.headers()) == (str(good), {"Authorization": "Bearer good-key"})
    key.load("")
    assert key.headers() == {}


@pytest.mark.parametrize("status", [401, 403])
def test_an_engine_refusing_the_credentials_is_a_sidecar_error_naming_the_setting(status):
    err = _http_error(status, b'{"error": "Unauthorized"}')
    assert err.kind == "unauthorized" and err.status == status
    assert "engine.apiKeyFile" in err.message and "Unauthorized" in err.message
    http_status, body = status_of(err)
    assert http_status == 502 and body["error"]["code"] == "engine_unauthorized"  # never the caller's own 401
    code, message = _status_of(err)
    assert code.name == "INTERNAL" and "engine.apiKeyFile" in message


@pytest.mark.parametrize(
    ("scrape", "engine", "same"),
    [
        ("http://127.0.0.1:8000/metrics", "http://127.0.0.1:8000", True),
        ("http://LOCALHOST/metrics", "http://localhost:80", True),
        ("https://vllm:443/metrics", "https://vllm", True),
        ("http://127.0.0.1:8001/metrics", "http://127.0.0.1:8000", False),
        ("https://127.0.0.1:8000/metrics", "http://127.0.0.1:8000", False),
        ("http://prometheus:9090/metrics", "http://127.0.0.1:8000", False),
    ],
)
def test_only_a_scrape_of_the_engines_own_address_carries_the_key(scrape, engine, same):
    assert same_origin(scrape, engine) is same
    cfg = parse_config({"engine": {"url": engine}, "metrics": {"url": scrape}})
    source = metrics_source(cfg, EngineKey("/k", KEY))
    sent = source.headers() if source.headers is not None else {}
    assert sent == ({"Authorization": f"Bearer {KEY}"} if same else {})
