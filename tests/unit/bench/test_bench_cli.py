from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
from bench_fake_server import FakeOpenAI

import modeldock
from modeldock.bench.cli import add_arguments, options_from_args, parse_tiers
from modeldock.bench.target import resolve_url

REPO = Path(modeldock.__file__).resolve().parent.parent


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="modeldock bench")
    add_arguments(p)
    return p


def test_concurrency_tiers() -> None:
    assert parse_tiers("8") == (8,)
    assert parse_tiers("1,16,64") == (1, 16, 64)
    for bad in ("0", "1,x", "", "4,-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_tiers(bad)


def test_flags_become_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_TOKEN", "abc")
    args = parser().parse_args(
        (
            "--url http://h/v1 --model m --requests 5 --concurrency 1,4 --warmup 2 --prompt-tokens 64 "
            "--max-tokens 16 --endpoint completions --usage --timeout 3.5"
        ).split()
    )
    options = options_from_args(args)
    assert options.concurrency == (1, 4) and options.requests == 5 and options.warmup == 2
    assert (options.prompt_tokens, options.max_tokens, options.endpoint) == (64, 16, "completions")
    assert options.usage and options.timeout == 3.5 and options.token == "abc"
    monkeypatch.delenv("GATEWAY_TOKEN")
    assert options_from_args(args).token is None


def test_bad_flags_are_rejected() -> None:
    for argv in (["--requests", "0"], ["--warmup", "-1"], ["--timeout", "0"], ["--endpoint", "embeddings"]):
        with pytest.raises(SystemExit):
            parser().parse_args(["--url", "u", "--model", "m", *argv])


async def run_cli(*argv: str, token: str | None = None) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if k != "GATEWAY_TOKEN"}
    if token is not None:
        env["GATEWAY_TOKEN"] = token
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "modeldock.bench",
        *argv,
        cwd=REPO,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_cli_json_is_the_only_thing_on_stdout(fake_openai: FakeOpenAI) -> None:
    fake_openai.script.behaviours = {2: "500"}
    code, out, err = await run_cli(
        "--url",
        fake_openai.base_url,
        "--model",
        "m",
        "--requests",
        "3",
        "--concurrency",
        "1,2",
        "--usage",
        "--json",
        "--timeout",
        "5",
        token="secret-token",
    )
    assert code == 0, err
    data = json.loads(out)  # fails if anything but JSON reached stdout
    assert data["schema"] == "modeldock.bench/1"
    assert [t["params"]["concurrency"] for t in data["tiers"]] == [1, 2]
    first, second = data["tiers"]
    assert first["errors"] == {"500": 1} and first["completed"] == 2
    assert second["errors"] == {} and second["completed"] == 3
    assert first["params"]["usage"] is True and first["params"]["model"] == "m"
    assert first["ttft_s"]["count"] == 2 and first["tpot_s"]["count"] == 2
    assert "\r" not in err  # stderr is not a terminal and --progress was not given
    assert set(fake_openai.auth_headers) == {"Bearer secret-token"}
    assert "secret-token" not in out


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib is not installed (the `plot` extra)")
async def test_cli_table_progress_and_plot(fake_openai: FakeOpenAI, tmp_path: Path) -> None:
    plot = tmp_path / "ttft.png"
    code, out, err = await run_cli(
        "--url",
        fake_openai.base_url,
        "--model",
        "m",
        "--requests",
        "2",
        "--concurrency",
        "1,2",
        "--warmup",
        "1",
        "--progress",
        "--plot",
        str(plot),
        "--timeout",
        "5",
    )
    assert code == 0, err
    assert "concurrency 1 |" in out and "concurrency 2 |" in out and "TTFT" in out
    assert "\rconcurrency 2 measure" in err
    assert plot.read_bytes()[:4] == b"\x89PNG"


async def test_cli_exits_nonzero_when_nothing_completed(fake_openai: FakeOpenAI) -> None:
    fake_openai.script.behaviours = {0: "429", 1: "429"}
    code, out, err = await run_cli("--url", fake_openai.base_url, "--model", "m", "--requests", "2", "--json")
    assert code == 1, err
    assert json.loads(out)["tiers"][0]["errors"] == {"429": 2}


def test_url_may_be_a_base_a_server_or_a_full_endpoint() -> None:
    cases = {
        ("http://h:8000/v1", None): ("http://h:8000/v1", "chat"),
        ("http://h:8000/v1/", "completions"): ("http://h:8000/v1", "completions"),
        ("http://h:8000", None): ("http://h:8000/v1", "chat"),
        ("http://h:8000/", None): ("http://h:8000/v1", "chat"),
        ("http://h:8000/v1/chat/completions", None): ("http://h:8000/v1", "chat"),
        ("http://h:8000/v1/chat/completions/", "chat"): ("http://h:8000/v1", "chat"),
        ("http://h:8000/v1/completions", None): ("http://h:8000/v1", "completions"),
        ("https://gw.example/openai/v1/chat/completions", None): ("https://gw.example/openai/v1", "chat"),
    }
    for (url, endpoint), expected in cases.items():
        assert resolve_url(url, endpoint) == expected, url
    for url, endpoint in (("http://h/v1/chat/completions", "completions"), ("h:8000/v1", None), ("ftp://h/v1", None)):
        with pytest.raises(ValueError):
            resolve_url(url, endpoint)


async def test_cli_takes_a_full_endpoint_url_and_defaults_to_the_first_listed_model(fake_openai: FakeOpenAI) -> None:
    code, out, err = await run_cli(
        "--url", fake_openai.base_url + "/chat/completions", "--requests", "3", "--concurrency", "2", "--json",
        "--timeout", "5", token="tok",
    )
    assert code == 0, err
    data = json.loads(out)
    assert data["tiers"][0]["completed"] == 3 and data["tiers"][0]["errors"] == {}
    assert data["tiers"][0]["params"]["model"] == "first-model"
    assert "using 'first-model', the first of 2 model(s)" in err
    assert fake_openai.paths == ["/v1/chat/completions"] * 3  # not .../chat/completions/chat/completions
    assert {b["model"] for b in fake_openai.bodies} == {"first-model"}
    assert set(fake_openai.auth_headers) == {"Bearer tok"}  # the model list was asked with the token too


async def test_cli_without_model_and_no_models_listed_says_so(fake_openai: FakeOpenAI) -> None:
    fake_openai.model_ids = []
    code, out, err = await run_cli("--url", fake_openai.base_url, "--requests", "1", "--json")
    assert code == 2 and out == ""
    assert "lists no models; pass --model" in err
    assert fake_openai.arrivals == 0
