"""A model's upstream credential (models[].upstream_auth): read, rotated without a restart, sent to Envoy as
metadata, and never shown in a log, a repr, an error or config-check's output."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from modeldock.cli import main
from modeldock.clock import FakeClock
from modeldock.config import ConfigError, UpstreamAuthConfig, hash_key, parse_config
from modeldock.extproc.flow import RequestFlow
from modeldock.gateway.credentials import UpstreamCredential
from tests.support.extproc_messages import body_request, make_gateway

KEY = "k-acme"
SECRET = "sk-vllm-secret-0001"


def config(auth: dict[str, object]) -> dict[str, object]:
    return {
        "tenants": [{"id": "acme", "api_key_hashes": [hash_key(KEY)], "models": ["*"]}],
        "models": [{"name": "locked", "endpoints": ["10.0.0.1:8000"], "upstream_auth": auth},
                   {"name": "open", "endpoints": ["10.0.0.2:8000"]}],
    }


def post(model: str) -> object:
    return body_request(json.dumps({"model": model}).encode(), request_id="r1", authorization=f"Bearer {KEY}")


@pytest.mark.parametrize("auth, where", [
    ({}, "models[0].upstream_auth: give exactly one of `env` or `file`"),
    ({"env": "A", "file": "/k"}, "models[0].upstream_auth: give exactly one of `env` or `file`"),
    ({"env": "not a name"}, "models[0].upstream_auth.env:"),
    ({"header": "x-other", "env": "A"}, "models[0].upstream_auth.header:"),
    ({"scheme": "Two words", "env": "A"}, "models[0].upstream_auth.scheme:"),
    ({"file": " "}, "models[0].upstream_auth.file:"),
    ({"env": "A", "token": "x"}, "models[0].upstream_auth.token:"),
])
def test_validation_names_the_field(auth: dict[str, object], where: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(config(auth))
    assert where in str(info.value)


def test_defaults_and_header_case() -> None:
    auth = parse_config(config({"env": "VLLM_KEY"})).models[0].upstream_auth
    assert auth == UpstreamAuthConfig(header="authorization", scheme="Bearer", env="VLLM_KEY")
    raw = parse_config(config({"header": "X-API-Key", "scheme": "", "file": "/k"})).models[0].upstream_auth
    assert raw is not None and (raw.header, raw.scheme) == ("x-api-key", "")


def test_env_value_with_scheme_or_raw() -> None:
    clock = FakeClock()
    bearer = UpstreamCredential(UpstreamAuthConfig(env="K"), clock, environ={"K": f"{SECRET}\n"})
    assert (bearer.header, bearer.value()) == ("authorization", f"Bearer {SECRET}")
    raw = UpstreamCredential(UpstreamAuthConfig(header="x-api-key", scheme="", env="K"), clock, environ={"K": SECRET})
    assert (raw.header, raw.value()) == ("x-api-key", SECRET)
    missing = UpstreamCredential(UpstreamAuthConfig(env="K"), clock, environ={})
    assert missing.value() is None and "environment variable K" in missing.problem
    assert SECRET not in repr(bearer) and SECRET not in repr(raw)


def test_a_rotated_file_is_read_again_stat_at_most_once_a_second(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    key = tmp_path / "key"
    key.write_text(SECRET + "\n")
    clock = FakeClock()
    stats: list[str] = []
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: (stats.append(str(p)), real_stat(p, *a, **k))[1])
    cred = UpstreamCredential(UpstreamAuthConfig(file=str(key)), clock)
    assert cred.value() == f"Bearer {SECRET}" and len(stats) == 1
    for _ in range(100):  # the hot path: no stat within the second
        assert cred.value() == f"Bearer {SECRET}"
    assert len(stats) == 1
    key.write_text("sk-rotated-0002-longer\n")
    assert cred.value() == f"Bearer {SECRET}"  # not looked at yet
    clock.advance(1.0)
    assert cred.value() == "Bearer sk-rotated-0002-longer" and len(stats) == 2
    # A Secret volume swaps a symlink: a same-size file of another inode is a change too.
    fresh = tmp_path / "key.new"
    fresh.write_text("sk-rotated-0003-longer\n")
    fresh.replace(key)
    clock.advance(1.0)
    assert cred.value() == "Bearer sk-rotated-0003-longer"
    key.unlink()
    clock.advance(1.0)
    assert cred.value() is None and "cannot be read" in cred.problem and str(key) in cred.problem


async def test_the_flow_sends_the_credential_as_metadata_only(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text(SECRET)
    gw = make_gateway(config({"file": str(key)}), {"locked": ["10.0.0.1:8000"], "open": ["10.0.0.2:8000"]})
    flow = RequestFlow(gw, "rid-1")
    resp = await flow.handle(post("locked"))
    assert resp.WhichOneof("response") == "request_body"
    assert not resp.request_body.response.header_mutation.set_headers  # ignored by Envoy: metadata instead
    md = resp.dynamic_metadata
    assert dict(md["modeldock.upstream_auth"]) == {"authorization": f"Bearer {SECRET}"}
    assert md["modeldock"]["rid"] == "rid-1" and md["modeldock"]["tenant"] == "acme"
    assert SECRET not in repr(flow.routed)
    flow.finish()
    other = await RequestFlow(gw, "rid-2").handle(post("open"))
    assert "modeldock.upstream_auth" not in other.dynamic_metadata


async def test_an_unreadable_credential_is_a_503_that_holds_nothing(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    key = tmp_path / "missing"
    gw = make_gateway(config({"file": str(key)}), {"locked": ["10.0.0.1:8000"]})
    resp = await RequestFlow(gw).handle(post("locked"))
    assert resp.immediate_response.status.code == 503
    error = json.loads(resp.immediate_response.body)["error"]
    assert error["code"] == "upstream_credential_unavailable" and str(key) not in error["message"]
    assert gw.picker.total_in_flight() == 0 and gw.admission.in_flight("acme") == 0
    assert any(str(key) in r.getMessage() and "r1" in r.getMessage() for r in caplog.records)
    # It appears: the next request after the check interval goes through; the log never shows the value.
    key.write_text(SECRET)
    gw.clock.advance(1.0)  # type: ignore[attr-defined]
    resp = await RequestFlow(gw).handle(post("locked"))
    assert resp.WhichOneof("response") == "request_body"
    assert not [r for r in caplog.records if SECRET in r.getMessage()]


def test_config_check_shows_no_secret(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml

    monkeypatch.setenv("VLLM_KEY", SECRET)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config({"env": "VLLM_KEY"})))
    assert main(["config", "check", str(path)]) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(config({"env": "VLLM_KEY", "file": "/k"})))
    with pytest.raises(SystemExit) as info:
        main(["config", "check", str(bad)])
    assert info.value.code == 2
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err
