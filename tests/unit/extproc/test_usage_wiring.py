"""ext_proc opens the usage records named by the config's `usage:` at start and refuses to start without them."""

from __future__ import annotations

from pathlib import Path

import pytest

from modeldock.config import ConfigError, parse_config
from modeldock.extproc.app import ExtProcOptions, ExtProcServer
from modeldock.usage.writer import UsageSinkError

MODELS = [{"name": "m", "endpoints": ["10.0.0.1:8000"]}]


def test_usage_is_off_unless_configured() -> None:
    config = parse_config({"models": MODELS})
    assert config.usage is None
    server = ExtProcServer(config, ExtProcOptions("127.0.0.1:1"))
    assert server.usage.sink is None and not server.gateway.records_on


def test_an_unwritable_usage_path_stops_ext_proc_with_a_clear_message(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    config = parse_config({"models": MODELS, "usage": {"path": str(blocker / "usage.jsonl"), "replica": "r1"}})
    with pytest.raises(UsageSinkError, match="usage.path: cannot write usage records to"):
        ExtProcServer(config, ExtProcOptions("127.0.0.1:1"))


def test_usage_records_on(tmp_path: Path) -> None:
    config = parse_config({"models": MODELS, "usage": {"path": str(tmp_path / "usage.jsonl"), "replica": "r1"}})
    server = ExtProcServer(config, ExtProcOptions("127.0.0.1:1"))
    try:
        assert server.gateway.records_on and (tmp_path / "usage.r1.jsonl").exists()
    finally:
        server.usage.close()


def test_a_bad_usage_section_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="usage"):
        parse_config({"models": MODELS, "usage": {"max_files": 0}})
