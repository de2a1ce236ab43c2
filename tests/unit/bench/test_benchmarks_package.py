"""The benchmarks as a package: run as `python -m benchmarks.x` with no sys.path edits, the stack and Redis helpers
from modeldock.devstack (not tests/), one percentile rule (modeldock.bench's nearest rank), and the test tiers."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.xds_latency import row
from tests import conftest

ROOT = Path(__file__).resolve().parents[3]
BENCHMARKS = sorted((ROOT / "benchmarks").rglob("*.py"))


def _imports(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_every_benchmark_folder_is_a_package() -> None:
    folders = {path.parent for path in BENCHMARKS}
    assert folders, "no benchmarks found"
    assert [f for f in folders if not (f / "__init__.py").exists()] == []


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_benchmark_edits_sys_path_or_starts_processes_from_tests(path: Path) -> None:
    tree = ast.parse(path.read_text())
    edits = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute)
             and node.attr == "path" and isinstance(node.value, ast.Name) and node.value.id == "sys"]
    assert edits == [], f"{path.name} touches sys.path at lines {edits}"
    assert _imports(tree) & {"tests.support.stack", "tests.support.redis_server"} == set()


@pytest.mark.parametrize("path", [p for p in BENCHMARKS if p.name != "openai_client.py"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_reproduce_command_runs_the_module(path: Path) -> None:
    # openai_client.py is the cross-check's independent process, started as a file on purpose.
    scripts = re.findall(r"python3? (benchmarks/\S+\.py)", path.read_text())
    assert scripts == [], f"{path.name} still says to run {scripts}; `python -m benchmarks.<name>` it is"


def test_every_reproduce_line_of_the_doc_runs_a_module() -> None:
    commands = re.findall(r"Reproduce: `([^`]*)`", (ROOT / "docs" / "benchmarks.md").read_text())
    assert commands, "no Reproduce lines in docs/benchmarks.md"
    assert [c for c in commands if re.search(r"benchmarks/\S+\.py", c)] == []


def test_percentiles_are_nearest_rank() -> None:
    # Four changes of 1, 2, 3 and 4 ms: nearest rank puts p50 at the 2nd value (ceil(0.5 * 4)) and p99 at the 4th.
    # The interpolating index the table used before, round(0.5 * 3), read the 3rd.
    assert row("total", 1, 2, [0.004, 0.001, 0.003, 0.002]) == ["1 x 2", "total", "2.0", "4.0", "4.0"]


def test_files_under_e2e_are_marked_e2e_even_without_pytestmark() -> None:
    marked: list[str] = []

    def item(path: Path) -> SimpleNamespace:
        return SimpleNamespace(path=path, add_marker=lambda mark, p=path: marked.append(f"{p.name}:{mark.name}"))

    tests = ROOT / "tests"
    conftest.pytest_collection_modifyitems([  # type: ignore[list-item]
        item(tests / "e2e" / "mesh" / "test_picker_mode.py"), item(tests / "unit" / "bench" / "test_x.py")])
    assert marked == ["test_picker_mode.py:e2e"]
