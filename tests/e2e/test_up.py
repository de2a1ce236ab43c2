"""`modeldock up` as a user runs it: one command, a working gateway, nothing left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from modeldock.up import free_port

pytestmark = pytest.mark.e2e


def descendants(pid: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start_up(tmp_path: Path, env_key: str | None) -> tuple[subprocess.Popen[str], int, list[str], float]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "MODELDOCK_API_KEY"}
    if env_key:
        env["MODELDOCK_API_KEY"] = env_key
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "modeldock", "up", "--port", str(port), "--backends", "2", "--speed", "10",
         "--run-dir", str(tmp_path / "run")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    lines: list[str] = []
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("  Ctrl-C"):
            return proc, port, lines, started
    proc.kill()
    raise AssertionError("modeldock up did not come up:\n" + "".join(lines))


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_up_serves_then_stops_leaving_nothing(tmp_path: Path, stop_signal: signal.Signals) -> None:
    import openai

    proc, port, lines, started = start_up(tmp_path, "md-e2e-up-key")
    try:
        output = "".join(lines)
        assert f"http://127.0.0.1:{port}/v1" in output
        assert "curl -s" in output and "$MODELDOCK_API_KEY" in output
        assert "md-e2e-up-key" not in output  # a key from the environment is not echoed
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="md-e2e-up-key", max_retries=0)
        reply = client.chat.completions.create(model="demo-model", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=3)
        first_success = time.perf_counter() - started
        assert reply.choices[0].message.content
        print(f"\nmodeldock up -> first successful completion: {first_success:.2f}s")
        children = descendants(proc.pid)
        assert len(children) >= 5  # 2 simulators, xDS, ext_proc, Envoy
    finally:
        proc.send_signal(stop_signal)
        code = proc.wait(30)
    assert code == 0
    time.sleep(0.2)
    left = [pid for pid in children if alive(pid)]
    assert not left, f"processes left behind: {left}"


def test_up_generates_and_prints_a_key_when_none_is_set(tmp_path: Path) -> None:
    import openai

    proc, port, lines, _ = start_up(tmp_path, None)
    try:
        match = re.search(r"API key for the demo tenant: (\S+)", "".join(lines))
        assert match, "".join(lines)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=match.group(1), max_retries=0)
        assert [m.id for m in client.models.list()] == ["demo-model"]
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def test_up_with_a_bad_config_names_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n- name: m\n  endpoints: ['not-an-ip:80']\n")
    result = subprocess.run([sys.executable, "-m", "modeldock", "up", "--config", str(bad), "--port",
                             str(free_port())], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"{bad}: models[0].endpoints: 'not-an-ip' in 'not-an-ip:80' is not an IP address" in result.stderr
