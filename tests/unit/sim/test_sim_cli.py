"""`modeldock sim` flags, and a real process that starts fast and stops cleanly on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import sys
import time

import aiohttp
import pytest

from modeldock.sim.cli import add_arguments, config_from_args, run


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_match_the_documented_ones() -> None:
    config = config_from_args(parse())
    assert (config.host, config.port, config.model) == ("127.0.0.1", 8000, "demo-model")
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.block_size) == (64, 2048, 16)
    assert config.num_gpu_blocks == 4096 and config.enable_prefix_caching and config.speed == 1.0
    assert config.default_max_tokens == 16


def test_every_engine_knob_has_a_flag() -> None:
    config = config_from_args(parse(
        "--port", "0", "--model", "m", "--max-num-seqs", "3", "--max-num-batched-tokens", "64",
        "--max-model-len", "512", "--block-size", "8", "--num-gpu-blocks", "100", "--no-enable-prefix-caching",
        "--default-max-tokens", "4", "--step-base-ms", "1.5", "--prefill-token-ms", "0.01",
        "--decode-seq-ms", "0.2", "--speed", "10",
    ))
    assert (config.port, config.model, config.max_num_seqs, config.max_num_batched_tokens) == (0, "m", 3, 64)
    assert (config.max_model_len, config.block_size, config.num_gpu_blocks) == (512, 8, 100)
    assert not config.enable_prefix_caching and config.default_max_tokens == 4
    assert (config.step_base_ms, config.prefill_token_ms, config.decode_seq_ms, config.speed) == (1.5, 0.01, 0.2, 10)


def test_an_impossible_config_exits_with_an_error() -> None:
    assert run(parse("--num-gpu-blocks", "1", "--max-model-len", "100")) == 2


async def test_process_serves_and_stops_on_sigterm() -> None:
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "modeldock.sim", "--port", "0", "--speed", "20", "--model", "cli-model",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stderr is not None
        line = (await asyncio.wait_for(proc.stderr.readline(), timeout=10)).decode()
        ready_after = time.monotonic() - started
        match = re.search(r"'cli-model' at (http://127\.0\.0\.1:\d+)/v1", line)
        assert match, line
        url = match.group(1)
        # Interpreter start included; the simulator itself starts in well under a second.
        assert ready_after < 3.0, f"took {ready_after:.2f}s to start"
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/health") as resp:
                assert resp.status == 200
            body = {"model": "cli-model", "prompt": "hi", "max_tokens": 2}
            async with http.post(url + "/v1/completions", json=body) as resp:
                assert (await resp.json())["usage"]["completion_tokens"] == 2
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_api_key_from_the_flag_or_vllms_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert config_from_args(parse()).api_key is None
    assert config_from_args(parse("--api-key", "k1")).api_key == "k1"
    monkeypatch.setenv("VLLM_API_KEY", "k2")
    assert config_from_args(parse()).api_key == "k2"
    assert config_from_args(parse("--api-key", "k1")).api_key == "k1"
