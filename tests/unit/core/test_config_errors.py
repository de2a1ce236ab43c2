"""Config errors name the file, line, column and problem, and never echo source text (a Redis password)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from modeldock.cli import main
from modeldock.config import ConfigError, load_config, parse_config, redis_url_problem, with_env_redis
from modeldock.extproc.app import ExtProcOptions, ExtProcServer

SECRET = "hunter2-s3cret"
MODELS = "models: [{name: m, endpoints: ['10.0.0.1:8000']}]\n"
# Line 3 has a YAML syntax error (a second `: ` in a plain scalar) at column 52, on the line with the password.
BROKEN_LINE = f"  redis_url: redis://app:{SECRET}@10.0.0.5:6379/0 : x"
BROKEN = MODELS + "limits:\n" + BROKEN_LINE + "\n"


def assert_clean(message: str) -> None:
    assert SECRET not in message
    assert "redis://" not in message
    assert BROKEN_LINE.strip() not in message
    assert "^" not in message  # PyYAML's snippet marks the column with a caret


def broken_file(tmp_path: Path) -> Path:
    path = tmp_path / "gw.yaml"
    path.write_text(BROKEN)
    return path


def test_a_yaml_syntax_error_names_file_line_column_and_problem_but_not_the_line(tmp_path: Path) -> None:
    path = broken_file(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    message = str(info.value)
    column = BROKEN_LINE.index(" : x") + 2  # 1-based column of the second ':'
    assert message.startswith(f"{path}:3:{column}: not valid YAML: ")
    assert "mapping values are not allowed here" in message
    assert_clean(message)


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (f"x: *{SECRET}\n", "1:4"),  # an undefined alias: PyYAML quotes its name
        (f"x: !{SECRET} y\n", "1:4"),  # an unknown tag: quoted too
        (f'x: "a\\q{SECRET}"\n', "1:7"),  # a bad escape: the character is quoted
        ("x: [1, 2\ny: 3\n", "2:2"),
        ("x: \x07\n", "1:4"),  # a control character (PyYAML's ReaderError has no marks)
    ],
)
def test_other_yaml_errors_keep_their_position_and_drop_quoted_source(tmp_path: Path, text: str, where: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    message = str(info.value)
    assert message.startswith(f"{path}:{where}: not valid YAML: ")
    assert SECRET not in message and "\x07" not in message


def test_a_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes(b"x: \xff\n")
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte offset 3\)"):
        load_config(path, environ={})


def test_config_check_prints_position_not_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = broken_file(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["config", "check", str(path)])
    assert info.value.code == 2
    out = capsys.readouterr()
    assert f"{path}:3:" in out.err and "mapping values are not allowed here" in out.err
    assert_clean(out.out + out.err)


def test_a_failed_reload_logs_position_not_the_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text(MODELS)
    server = ExtProcServer(load_config(path, environ={}), ExtProcOptions("127.0.0.1:1", config_path=path))
    path.write_text(BROKEN)
    with caplog.at_level(logging.ERROR, logger="modeldock.extproc"):
        server._reload_config(path)
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "config reload failed; keeping the last good config" in logged
    assert f"{path}:3:" in logged and "mapping values are not allowed here" in logged
    assert_clean(logged)


def test_pydantic_errors_never_echo_the_value() -> None:
    data = {
        "models": [{"name": "m", "endpoints": ["10.0.0.1:8000"]}],
        "limits": {"redis_fail_open": SECRET, "redis_timeout_ms": SECRET, "redis_url": {"password": SECRET}},
        "listener": {"idle_timeout_seconds": [SECRET]},
    }
    with pytest.raises(ConfigError) as info:
        parse_config(data, "gw.yaml")
    message = str(info.value)
    for field in ("limits.redis_fail_open", "limits.redis_timeout_ms", "limits.redis_url",
                  "listener.idle_timeout_seconds"):
        assert f"gw.yaml: {field}: " in message
    assert SECRET not in message


def test_a_value_turned_key_by_bad_indentation_is_not_shown(tmp_path: Path) -> None:
    # `redis_url:` left empty and the URL on the next line at the same depth: the URL becomes a key.
    path = tmp_path / "gw.yaml"
    path.write_text(MODELS + f"limits:\n  redis_url:\n  redis://app:{SECRET}@h: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    message = str(info.value)
    assert "limits." in message and "not permitted" in message
    assert_clean(message)
    with pytest.raises(ConfigError, match=r"limits\.redis_ur: Extra inputs"):  # a plain typo is still named
        parse_config({"models": [{"name": "m", "endpoints": ["10.0.0.1:8000"]}], "limits": {"redis_ur": "x"}})


@pytest.mark.parametrize(
    "url",
    [
        f"http://app:{SECRET}@10.0.0.5:6379/0",
        f"https://app:{SECRET}@10.0.0.5/0",
        f"app:{SECRET}@10.0.0.5:6379",
        f"redis://app:{SECRET}@/0",  # no host
        f"redis://app:{SECRET}@10.0.0.5:99999/0",  # no such port
        f"redis://app:{SECRET}@10.0.0.5:0/0",
        f"redis://app:{SECRET}@[::1/0",  # unparseable host
        f"unix://app:{SECRET}@",  # no socket path
        f"{SECRET}",
        f"redis+sentinel://app:{SECRET}@10.0.0.5:26379",  # no master name
        f"redis+sentinel://app:{SECRET}@/mymaster",  # no Sentinel
        f"redis+sentinel://app:{SECRET}@10.0.0.5:99999/mymaster",  # no such port
        f"redis+sentinel://app:{SECRET}@10.0.0.5,:26379/mymaster",  # the second address has no host
        f"redis+sentinel://app:{SECRET}@10.0.0.5/mymaster/x",  # the db is not a number
        f"redis+sentinel://app:{SECRET}@10.0.0.5/mymaster/0/extra",
        f"redis+sentinel://10.0.0.5/mymaster?password={SECRET}",  # an unknown query parameter
    ],
)
def test_bad_redis_urls_are_refused_without_echoing_them(tmp_path: Path, url: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text(MODELS + f"limits: {{redis_url: '{url}'}}\n")
    with pytest.raises(SystemExit):
        main(["config", "check", str(path)])
    err = capsys.readouterr().err
    assert f"{path}: limits.redis_url: " in err
    assert SECRET not in err and url not in err

    plain = tmp_path / "plain.yaml"
    plain.write_text(MODELS)
    with pytest.raises(ConfigError) as info:
        load_config(plain, environ={"REDIS_URL": url})
    assert "REDIS_URL" in str(info.value)
    assert SECRET not in str(info.value) and url not in str(info.value)


@pytest.mark.parametrize(
    "url",
    ["redis://127.0.0.1:6379/0", f"redis://app:{SECRET}@redis.internal:6379", "rediss://h/1", "redis://h",
     "redis://[::1]:6379", "unix:///run/redis.sock", f"unix://app:{SECRET}@/run/redis.sock?db=2",
     "redis+sentinel://10.0.0.5/mymaster", f"redis+sentinel://app:{SECRET}@s1:26379,s2,[::1]:26380/mymaster/2",
     f"REDIS+SENTINEL://s1/mymaster?sentinel_username=sen&sentinel_password={SECRET}"],
)
def test_redis_urls_redis_py_takes_are_accepted(url: str) -> None:
    assert redis_url_problem(url) is None
    config = parse_config({"models": [{"name": "m", "endpoints": ["10.0.0.1:8000"]}], "limits": {"redis_url": url}})
    assert config.limits.redis_url == url
    plain = parse_config({"models": [{"name": "m", "endpoints": ["10.0.0.1:8000"]}]})
    assert with_env_redis(plain, {"REDIS_URL": url}).limits.redis_url == url
