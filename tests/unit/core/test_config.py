from __future__ import annotations

from pathlib import Path

import pytest

from modeldock.config import ConfigError, hash_key, load_config, parse_config

GOOD = {
    "tenants": [{"id": "t", "api_key_hashes": [hash_key("k")], "models": ["m"]}],
    "models": [{"name": "m", "endpoints": ["127.0.0.1:8000", "[::1]:8001"]}],
}


def test_good_config_loads(tmp_path: Path) -> None:
    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(GOOD))
    config = load_config(path)
    assert config.model("m").static_endpoints()[1].address == "[::1]:8001"
    assert config.tenants[0].allows("m") and not config.tenants[0].allows("x")


@pytest.mark.parametrize(
    ("edit", "where", "reason"),
    [
        (lambda c: c["models"][0].update(endpoints=["localhost:80"]), "models[0].endpoints", "not an IP address"),
        (lambda c: c["models"][0].update(endpoints=["1.2.3.4:0"]), "models[0].endpoints", "1-65535"),
        (lambda c: c["tenants"][0].update(api_key_hashes=["plain-key"]), "tenants[0].api_key_hashes", "sha256"),
        (lambda c: c["tenants"][0].pop("models"), "tenants[0].models", "Field required"),
        (lambda c: c.update(routing={"policy": "random"}), "routing.policy", "'default'"),
        (lambda c: c.update(extra=1), "extra", "not permitted"),
        (lambda c: c["models"].append(dict(c["models"][0])), "(top level)", "appears twice"),
        (lambda c: c["models"][0].update(kubernetes={"namespace": "n", "service": "s", "port": 80}),
         "models[0]", "exactly one of"),
        (lambda c: c["models"][0].update(max_num_seqs=0), "models[0].max_num_seqs", "greater than or equal to 1"),
        (lambda c: c.update(queue={"share_window_seconds": 0}), "queue.share_window_seconds", "greater than 0"),
    ],
)
def test_bad_config_names_file_field_and_reason(edit, where: str, reason: str) -> None:
    import copy

    data = copy.deepcopy(GOOD)
    edit(data)
    with pytest.raises(ConfigError) as info:
        parse_config(data, "gw.yaml")
    assert f"gw.yaml: {where}: " in str(info.value)
    assert reason in str(info.value)


def test_unreadable_and_non_yaml_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:2:1: not valid YAML: "):
        load_config(bad)


def test_hash_key_is_sha256() -> None:
    assert hash_key("abc") == "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_redis_url_from_the_environment_only_when_the_file_sets_none(tmp_path: Path) -> None:
    plain = tmp_path / "plain.yaml"
    plain.write_text("models: [{name: m, endpoints: ['10.0.0.1:8000']}]\n")
    own = tmp_path / "own.yaml"
    own.write_text("models: [{name: m, endpoints: ['10.0.0.1:8000']}]\nlimits: {redis_url: 'redis://127.0.0.1:1/0'}\n")
    env = {"REDIS_URL": "redis://127.0.0.1:2/0"}
    assert load_config(plain, environ=env).limits.redis_url == "redis://127.0.0.1:2/0"
    assert load_config(own, environ=env).limits.redis_url == "redis://127.0.0.1:1/0"
    assert load_config(plain, environ={}).limits.redis_url is None
    assert parse_config({"models": [{"name": "m", "endpoints": ["10.0.0.1:8000"]}]}).limits.redis_url is None
