"""Who may call the sidecar (binbatch_sidecar.server.caller_auth, engine/admin_token.py, config ``auth``):
caller tokens from a directory, the Admin gate (loopback, admin token, operator-signed JWT), the
per-caller steering rights and hint trust, and a GetConfig that shows no credential."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import time

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from binbatch_sidecar.config import ConfigError, parse_config, redact_urls, shown_config_json
from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.engine.admin_token import (
    MAX_LIFETIME_SECONDS,
    TokenRefused,
    load_private_pem,
    new_private_pem,
    public_pem,
    sign,
    verify,
)
from binbatch_sidecar.engine.dispatcher import Completion
from binbatch_sidecar.engine.engine_client import EngineResult
from binbatch_sidecar.engine.engine_key import EngineKey
from binbatch_sidecar.engine.sidecar_metrics import SidecarMetrics
from binbatch_sidecar.server.caller_auth import (
    ADMIN_FIELD,
    AdminGate,
    CallerAuth,
    CallerTokens,
    Unauthenticated,
    bearer,
    is_loopback_peer,
    read_caller_tokens,
)
from binbatch_sidecar.server.front import Fields, Front

KEY = load_private_pem(new_private_pem())
OTHER_KEY = load_private_pem(new_private_pem())
PUBLIC = public_pem(KEY)
AUDIENCE = "llm/chat"


def problems_of(doc) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as err:
        parse_config(doc)
    return err.value.problems


def write_tokens(folder, tokens: dict[str, str]):
    folder.mkdir(exist_ok=True)
    for name, token in tokens.items():
        (folder / name).write_text(token)
    return folder


def kubelet_secret(folder, tokens: dict[str, str], stamp: str):
    """A Secret volume as the kubelet lays it out: ``name -> ..data/name``, ``..data -> ..<stamp>``."""
    folder.mkdir(exist_ok=True)
    data = folder / f"..{stamp}"
    data.mkdir()
    for name, token in tokens.items():
        (data / name).write_text(token)
    link = folder / "..data_tmp"
    link.symlink_to(data.name)
    os.replace(link, folder / "..data")  # the atomic swap
    for name in tokens:
        if not (folder / name).is_symlink():
            (folder / name).symlink_to(f"..data/{name}")
    return folder


# -- config ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("auth", "where", "words"),
    [
        ({"callers": [{"name": "a/b"}]}, "auth.callers[0].name", "pattern"),
        ({"callers": [{"name": "a"}, {"name": "a"}]}, "auth.callers[1].name", "duplicate caller 'a'"),
        ({"callers": [{"name": "a", "allowHints": "yes"}]}, "auth.callers[0].allowHints", "boolean"),
        ({"callers": [{"name": "a", "allowEverything": True}]}, "auth.callers[0].allowEverything", "Extra inputs"),
        ({"operatorPublicKeys": ["not a key"], "audience": "x"}, "auth.operatorPublicKeys", "entry 0 is not a PEM public key"),
        ({"operatorPublicKeys": [PUBLIC]}, "auth.audience", "must be set with operatorPublicKeys"),
        ({"callerTokensDir": "   "}, "auth.callerTokensDir", "only whitespace"),
        ({"adminTokenFile": " "}, "auth.adminTokenFile", "only whitespace"),
    ],
)  # fmt: skip
def test_a_bad_auth_entry_is_refused_naming_the_field(auth, where, words):
    problems = problems_of({"auth": auth})
    assert any(path == where and words in message for path, message in problems), problems


def test_an_operator_key_that_is_not_ed25519_is_refused():
    pem = ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()  # fmt: skip
    [(path, message)] = problems_of({"auth": {"operatorPublicKeys": [pem], "audience": "a"}})
    assert path == "auth.operatorPublicKeys" and "not an Ed25519 public key" in message


# -- the callers' tokens ------------------------------------------------------------------------------------------


def test_each_file_is_a_caller_and_its_content_the_token(tmp_path):
    tokens = CallerTokens()
    tokens.load(str(write_tokens(tmp_path / "t", {"team-a": "tok-a\n", "team.b": "  tok-b  "})))
    assert (tokens.caller("tok-a"), tokens.caller("tok-b"), tokens.caller("tok-c")) == ("team-a", "team.b", None)
    assert tokens.names == ["team-a", "team.b"] and "tok-a" not in repr(tokens)


@pytest.mark.parametrize(
    ("files", "words"),
    [
        (None, "cannot read the directory"),
        ({}, "holds no token file"),
        ({"a": "  \n"}, "is empty (or only whitespace)"),
        ({"a": "same", "b": "same"}, "callers 'a' and 'b' have the same token"),
        ({"a": "two words"}, "space or control character"),
        ({"a b": "t"}, "a caller's name is a Secret key"),
    ],
)  # fmt: skip
def test_a_token_directory_that_cannot_be_used_refuses_the_config_naming_the_key(tmp_path, files, words):
    folder = tmp_path / "t"
    if files is not None:
        write_tokens(folder, files)
    with pytest.raises(ConfigError) as err:
        read_caller_tokens(str(folder))
    [(path, message)] = err.value.problems
    assert path == "auth.callerTokensDir" and words in message
    assert "same" not in message.replace("the same token", "")  # never a token


def test_a_rotated_secret_is_picked_up_and_a_broken_one_keeps_the_tokens(tmp_path):
    folder = kubelet_secret(tmp_path / "t", {"team-a": "old"}, "1")
    tokens = CallerTokens()
    tokens.load(str(folder))
    assert tokens.caller("old") == "team-a" and tokens.refresh() is False
    kubelet_secret(folder, {"team-a": "new"}, "2")
    assert tokens.refresh() is True
    assert (tokens.caller("old"), tokens.caller("new")) == (None, "team-a")
    (folder / "..2" / "team-a").write_text("")  # a broken Secret: the tokens in use stay
    assert tokens.refresh() is False and tokens.caller("new") == "team-a"


@pytest.mark.parametrize(
    ("values", "words"),
    [([], "missing"), (["Bearer a", "Bearer b"], "more than once"), (["Basic dXNlcg=="], "not a bearer token"),
     (["Bearer "], "not a bearer token")],
)  # fmt: skip
def test_a_missing_or_malformed_authorization_is_refused_naming_it(values, words):
    with pytest.raises(Unauthenticated, match=words):
        bearer(values, "authorization")
    assert bearer(["bearer  tok "], "authorization") == "tok"


def test_caller_auth_counts_refusals_by_door_and_is_silent_when_off(tmp_path):
    metrics = SidecarMetrics()
    tokens = CallerTokens()
    tokens.load(str(write_tokens(tmp_path / "t", {"team-a": "tok-a"})))
    on = parse_config({"auth": {"callerTokensDir": str(tmp_path / "t")}})
    auth = CallerAuth(lambda: on, tokens, metrics)
    assert auth.authenticate("http", ["Bearer tok-a"], "Authorization") == "team-a"
    with pytest.raises(Unauthenticated, match="not a known caller's"):
        auth.authenticate("grpc", ["Bearer nope"], "authorization")
    with pytest.raises(Unauthenticated, match="missing"):
        auth.authenticate("grpc", [], "authorization")
    count = metrics.registry.get_sample_value
    assert count("binbatch_unauthenticated_total", {"door": "grpc"}) == 2
    assert count("binbatch_unauthenticated_total", {"door": "http"}) == 0
    off = CallerAuth(lambda: parse_config({}), CallerTokens(), metrics)
    assert off.authenticate("http", [], "Authorization") == ""


def test_refusals_are_logged_at_info_once_a_minute_per_door_with_a_count_and_never_the_token(tmp_path, caplog):
    caplog.set_level("DEBUG", logger="binbatch.auth")
    clock = ManualClock()
    tokens = CallerTokens()
    tokens.load(str(write_tokens(tmp_path / "t", {"team-a": "tok-a"})))
    on = parse_config({"auth": {"callerTokensDir": str(tmp_path / "t")}})
    auth = CallerAuth(lambda: on, tokens, None, clock=clock.now)
    for _ in range(3):
        with pytest.raises(Unauthenticated):
            auth.authenticate("http", ["Bearer guessed-token"], "Authorization")
    clock.advance(61)
    with pytest.raises(Unauthenticated):
        auth.authenticate("http", ["Bearer guessed-token"], "Authorization")
    infos = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert len(infos) == 2 and "refused 1 unauthenticated" in infos[0] and "refused 3 unauthenticated" in infos[1]
    assert len([r for r in caplog.records if r.levelname == "DEBUG"]) == 4
    assert "guessed-token" not in caplog.text and "tok-a" not in caplog.text


# -- the caller's steering rights and hint trust --------------------------------------------------------------


class Dispatcher:
    def submit(self, req, call) -> None:
        pass

    def cancel(self, req) -> None:
        pass


def test_a_callers_input_steers_only_if_both_its_class_and_the_caller_allow_it():
    cfg = parse_config({
        "engine": {"model": "m"},
        "classes": {"classes": [{"name": "open", "allowPriority": True, "allowSloHeaders": True}]},
        "auth": {"callerTokensDir": "/unused", "callers": [{"name": "low", "allowPriority": False}]},
    })  # fmt: skip
    metrics = SidecarMetrics()
    front = Front(Dispatcher(), ManualClock(), config=lambda: cfg, default_model=lambda: "m", metrics=metrics)  # type: ignore[arg-type]
    slo = {"x-slo-ttft-ms": 500}
    low = front.admit_inputs(Fields(prompt="p", priority=7, slo=slo, caller="low"), cfg.classes.inputs_of("open"), 100,
                             cfg.auth.inputs_of("low"))  # fmt: skip
    assert (low.priority, low.slo, low.ignored) == (0, slo, ("priority",))
    other = front.admit_inputs(Fields(prompt="p", priority=7, caller="x"), cfg.classes.inputs_of("open"), 100,
                               cfg.auth.inputs_of("x"))  # fmt: skip
    assert (other.priority, other.ignored) == (7, ())
    closed = front.admit_inputs(Fields(prompt="p", priority=7, caller="x"), cfg.classes.inputs_of(""), 100,
                                cfg.auth.inputs_of("x"))  # the default class allows priority: still honoured
    assert closed.priority == 7


async def test_a_lying_caller_loses_its_hints_without_taking_an_honest_callers_away():
    cfg = parse_config({"engine": {"model": "m"}, "bins": {"maxOutputTokens": 4096}})
    metrics = SidecarMetrics()
    front = Front(Dispatcher(), ManualClock(), config=lambda: cfg, default_model=lambda: "m", metrics=metrics)  # type: ignore[arg-type]
    for _ in range(12):
        for caller, actual in (("liar", 800), ("honest", 100)):
            ticket = front.build(Fields(prompt="p", expected_output_tokens=100, caller=caller), stream=False)
            front.finished(ticket, Completion(EngineResult("", "stop", 1, actual), 0.0, 0.0, 0, 1, 0.0))
    liar = front.build(Fields(prompt="p", expected_output_tokens=100, caller="liar"), stream=False)
    honest = front.build(Fields(prompt="p", expected_output_tokens=100, caller="honest"), stream=False)
    assert liar.req.hint_tokens is None and liar.ignored == ("hint",)
    assert honest.req.hint_tokens == 100 and honest.ignored == ()
    gauge = metrics.registry.get_sample_value
    assert gauge("binbatch_hints_distrusted", {"request_class": "_default", "caller": "liar"}) == 1
    assert gauge("binbatch_hints_distrusted", {"request_class": "_default", "caller": "honest"}) is None


# -- Admin: loopback, the admin token, the operator's JWT ---------------------------------------------------------


@pytest.mark.parametrize(
    ("peer", "loopback"),
    [
        ("ipv4:127.0.0.1:5000", True), ("ipv4:127.3.2.1:1", True), ("ipv6:[::1]:5000", True),
        ("ipv6:%5B::1%5D:5000", True), ("ipv6:[::ffff:127.0.0.1]:80", True),
        ("ipv4:10.0.0.5:1234", False), ("ipv6:[fe80::1%eth0]:80", False), ("ipv6:[2001:db8::1]:80", False),
        ("unix:/tmp/s", False), ("ipv4:localhost:1", False), ("", False), ("ipv6:::1:5", False),
    ],
)  # fmt: skip
def test_only_a_loopback_peer_counts_as_loopback(peer, loopback):
    assert is_loopback_peer(peer) is loopback


def gate(tmp_path, metrics=None, *, admin_token: str = "", keys=(PUBLIC,), audience=AUDIENCE) -> AdminGate:
    auth: dict = {}
    key = EngineKey(field=ADMIN_FIELD)
    if admin_token:
        (tmp_path / "admin").write_text(admin_token)
        auth["adminTokenFile"] = str(tmp_path / "admin")
        key.load(str(tmp_path / "admin"))
    if keys:
        auth |= {"operatorPublicKeys": list(keys), "audience": audience}
    cfg = parse_config({"auth": auth})
    return AdminGate(lambda: cfg, key, metrics)


REMOTE = "ipv4:10.0.0.5:1234"


def with_bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def test_admin_answers_loopback_without_a_credential_and_refuses_others_naming_what_is_missing(tmp_path):
    metrics = SidecarMetrics()
    g = gate(tmp_path, metrics)
    g.check("ipv4:127.0.0.1:40000", ())
    with pytest.raises(Unauthenticated, match="needs a credential: authorization: missing"):
        g.check(REMOTE, ())
    bare = gate(tmp_path, keys=())
    with pytest.raises(Unauthenticated, match=r"no admin credential is configured \(auth.adminTokenFile"):
        bare.check(REMOTE, with_bearer("anything"))
    assert metrics.registry.get_sample_value("binbatch_unauthenticated_total", {"door": "admin"}) == 1


def test_admin_takes_the_admin_token_or_an_operator_token(tmp_path):
    g = gate(tmp_path, admin_token="s3cret\n")
    g.check(REMOTE, with_bearer("s3cret"))
    g.check(REMOTE, with_bearer(sign(KEY, AUDIENCE)))
    with pytest.raises(Unauthenticated, match="not auth.adminTokenFile's"):
        g.check(REMOTE, with_bearer("s3cre"))


def hs256_with_public_key() -> str:
    """The classic confusion: an HMAC token keyed with the (public) verification key."""
    head = base64.urlsafe_b64encode(b'{"alg":"HS256","typ":"JWT"}').rstrip(b"=")
    claims = json.dumps({"aud": AUDIENCE, "exp": int(time.time()) + 60}).encode()
    body = base64.urlsafe_b64encode(claims).rstrip(b"=")
    mac = hmac.new(PUBLIC.encode(), head + b"." + body, hashlib.sha256).digest()
    return (head + b"." + body + b"." + base64.urlsafe_b64encode(mac).rstrip(b"=")).decode()


@pytest.mark.parametrize(
    ("token", "words"),
    [
        (lambda: sign(KEY, "llm/other"), "another audience"),
        (lambda: sign(KEY, AUDIENCE, now=lambda: time.time() - 3600), "expired"),
        (lambda: sign(KEY, AUDIENCE, lifetime=MAX_LIFETIME_SECONDS * 10), f"more than {MAX_LIFETIME_SECONDS} s ahead"),
        (lambda: sign(OTHER_KEY, AUDIENCE), "not in auth.operatorPublicKeys"),
        (lambda: hs256_with_public_key(), "only EdDSA"),
        (lambda: jwt.encode({"aud": AUDIENCE, "exp": int(time.time()) + 60}, None, algorithm="none"), "only EdDSA"),
        (lambda: jwt.encode({"aud": AUDIENCE}, KEY, algorithm="EdDSA"), "without the 'exp' claim"),
        (lambda: jwt.encode({"exp": int(time.time()) + 60}, KEY, algorithm="EdDSA"), "without the 'aud' claim"),
    ],
)  # fmt: skip
def test_an_operator_token_is_refused_unless_signed_by_its_key_for_this_audience_and_soon_to_expire(tmp_path, token, words):
    presented = token()
    with pytest.raises(TokenRefused, match=words):
        verify(presented, [PUBLIC], AUDIENCE)
    with pytest.raises(Unauthenticated, match=words):
        gate(tmp_path).check(REMOTE, with_bearer(presented))


def test_a_second_operator_key_is_accepted_while_keys_rotate():
    verify(sign(OTHER_KEY, AUDIENCE), [PUBLIC, public_pem(OTHER_KEY)], AUDIENCE)


# -- GetConfig shows no credential ------------------------------------------------------------------------------


def test_the_shown_config_redacts_url_credentials_and_shows_paths_only():
    cfg = parse_config({
        "engine": {"url": "https://svc:hunter2@vllm:8000", "apiKeyFile": "/k/api-key"},
        "metrics": {"source": "PromQL", "url": "http://prom:pw@prometheus:9090"},
        "predictor": {"external": {"url": "https://u@pred/x", "feedbackUrl": "https://u:p@pred/fb?q=a@b"}},
        "auth": {"callerTokensDir": "/t", "adminTokenFile": "/a", "operatorPublicKeys": [PUBLIC], "audience": AUDIENCE},
    })  # fmt: skip
    text = shown_config_json(cfg)
    shown = json.loads(text)
    assert "hunter2" not in text and "pw@" not in text and "u:p" not in text and "u@" not in text
    assert shown["engine"]["url"] == "https://***@vllm:8000"
    assert shown["metrics"]["url"] == "http://***@prometheus:9090"
    assert shown["predictor"]["external"]["url"] == "https://***@pred/x"
    assert shown["predictor"]["external"]["feedbackUrl"] == "https://***@pred/fb?q=a@b"
    assert (shown["engine"]["apiKeyFile"], shown["auth"]["callerTokensDir"], shown["auth"]["adminTokenFile"]) == ("/k/api-key", "/t", "/a")
    assert shown["auth"]["operatorPublicKeys"] == [PUBLIC]
    assert redact_urls("engine.url: got 'https://a:b@h'") == "engine.url: got 'https://***@h'"
