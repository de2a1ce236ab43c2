"""True floors: modeldock's import graph has no upward import and no cycle (docs/architecture.md, Floors).

The floors are read from the doc; `import_graph.py` (beside this file) walks the imports. The checker is
tested first on small packages written to tmp_path, so a clean result on modeldock means something.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from import_graph import Edge, Floors, Report, check, hidden_imports, import_edges, parse_floors

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "modeldock"
DOC = ROOT / "docs" / "architecture.md"

# Known violations being removed by the work named beside each, as (importing unit, imported unit): an
# edge between two such units is tolerated until its entry goes. Empty it as they land; the last test
# fails on an entry that no longer matches anything, so a stale one cannot hide a new import.
ALLOWED_FOR_NOW: dict[tuple[str, str], str] = {
}
# Rooms (packages) without a README.md saying what they own, for now -> who is writing it.
README_FOR_NOW: dict[str, str] = {
}
# Cycles tolerated for now: the sorted modules of one cycle -> who is removing it.
CYCLES_FOR_NOW: dict[tuple[str, ...], str] = {
}


def _write(base: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = base / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return base / "pkg"


FLOORS_DOC = """
<!-- floors:begin -->
```text
2 top:    app
1 middle: room other
allow: other -> room     # other builds on room
0 ground: pkg base room.section
```
<!-- floors:end -->
"""


def _floors() -> Floors:
    return parse_floors(FLOORS_DOC, "pkg")


def test_parse_floors_reads_units_floors_and_allowances() -> None:
    floors = _floors()
    assert dict(floors.floor_of) == {"app": 2, "room": 1, "other": 1, "pkg": 0, "base": 0, "room.section": 0}
    assert floors.allowed == {("other", "room")}
    assert floors.unit_of("pkg.room.section") == "room.section"
    assert floors.unit_of("pkg.room.section.deep") == "room.section"
    assert floors.unit_of("pkg.room.sectional") == "room"
    assert floors.unit_of("pkg") == "pkg"
    assert floors.unit_of("pkg.nowhere") is None


@pytest.mark.parametrize(
    "block",
    [
        "1 a: x\n0 b: x",  # one unit on two floors
        "1 a: x y\nallow: x -> z",  # an allowance naming an unlisted unit
        "1 a: x\n0 b: y\nallow: x -> y",  # an allowance across floors (not needed, so a mistake)
        "1 a x",  # unreadable
    ],
)
def test_parse_floors_refuses_a_list_that_cannot_mean_one_thing(block: str) -> None:
    with pytest.raises(ValueError):
        parse_floors(f"<!-- floors:begin -->\n{block}\n<!-- floors:end -->", "pkg")


def test_edges_count_function_type_checking_relative_and_package_init_imports(tmp_path: Path) -> None:
    package = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/base.py": "",
        "pkg/room/__init__.py": "from pkg.room.core import thing\n",
        "pkg/room/core.py": "from . import section\nthing = 1\n",
        "pkg/room/section.py": "",
        "pkg/lazy/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.lazy.x import y\n",
        "pkg/lazy/x.py": "y = 1\n",
        "pkg/app.py": (
            "import os\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import base\n"
            "def main() -> None:\n    from pkg.room.section import s\n    import pkg.lazy.x\n"
        ),
    })
    edges = {(e.source, e.target, e.kind) for e in import_edges(package)}
    assert ("pkg.app", "pkg.base", "type-checking") in edges
    assert ("pkg.app", "pkg.room.section", "function") in edges
    # pkg.room's __init__ loads pkg.room.core, so importing pkg.room.section loads it as well ...
    assert ("pkg.app", "pkg.room", "package-init") in edges
    # ... while pkg.lazy's __init__ loads nothing at run time.
    assert ("pkg.app", "pkg.lazy", "package-init") not in edges
    assert ("pkg.lazy", "pkg.lazy.x", "type-checking") in edges
    assert ("pkg.room.core", "pkg.room.section", "top") in edges  # relative
    # A module's own package has started before it runs: no edge back to it.
    assert not any(e.source == "pkg.room.core" and e.target == "pkg.room" for e in import_edges(package))
    assert not any(e.target == "os" for e in import_edges(package))


def test_a_clean_package_passes(tmp_path: Path) -> None:
    package = _write(tmp_path, {
        "pkg/__init__.py": "", "pkg/base.py": "", "pkg/room/__init__.py": "", "pkg/room/section.py": "",
        "pkg/room/core.py": "from pkg import base\nfrom pkg.room import section\n",
        "pkg/other.py": "from pkg.room import core\n", "pkg/app.py": "from pkg import other, room\n",
    })
    assert list(check(package, _floors()).lines()) == []


def test_an_upward_import_fails_even_deferred_in_a_function(tmp_path: Path) -> None:
    package = _write(tmp_path, {
        "pkg/__init__.py": "", "pkg/base.py": "def f() -> None:\n    from pkg.room import core\n",
        "pkg/room/__init__.py": "", "pkg/room/core.py": "", "pkg/other.py": "", "pkg/app.py": "",
    })
    report = check(package, _floors())
    assert [(e.source, e.target, e.kind) for e, _ in report.crossings] == [("pkg.base", "pkg.room.core", "function")]
    assert report.crossings[0][1].startswith("upward: base (ground) imports room (middle)")


def test_a_sideways_import_fails_unless_allowed(tmp_path: Path) -> None:
    package = _write(tmp_path, {
        "pkg/__init__.py": "", "pkg/base.py": "", "pkg/room/__init__.py": "from pkg import other\n",
        "pkg/room/section.py": "", "pkg/other.py": "from pkg import room\n", "pkg/app.py": "",
    })
    report = check(package, _floors())
    # other -> room is allowed; room -> other is not, and the pair is a cycle between rooms too.
    assert [(e.source, e.target) for e, _ in report.crossings] == [("pkg.room", "pkg.other")]
    assert report.crossings[0][1].startswith("sideways:")
    assert report.unit_cycles == [["other", "room"]]


def test_a_cycle_between_two_modules_of_one_room_fails(tmp_path: Path) -> None:
    package = _write(tmp_path, {
        "pkg/__init__.py": "", "pkg/base.py": "", "pkg/other.py": "", "pkg/app.py": "",
        "pkg/room/__init__.py": "", "pkg/room/section.py": "",
        "pkg/room/bands.py": "from pkg.room.queue import Q\n",
        "pkg/room/queue.py": "def later() -> None:\n    from pkg.room.bands import B\n",
    })
    report = check(package, _floors())
    assert report.crossings == []
    assert report.module_cycles == [["pkg.room.bands", "pkg.room.queue"]]


def test_a_module_without_a_floor_and_a_unit_without_modules_fail(tmp_path: Path) -> None:
    package = _write(tmp_path, {"pkg/__init__.py": "", "pkg/base.py": "", "pkg/room/__init__.py": "",
                                "pkg/room/section.py": "", "pkg/other.py": "", "pkg/new.py": ""})
    report = check(package, _floors())
    assert report.unplaced == ["pkg.new"]
    assert report.empty_units == ["app"]


def test_imports_by_computed_name_are_found_outside_a_lazy_package_init(tmp_path: Path) -> None:
    package = _write(tmp_path, {
        "pkg/__init__.py": "from importlib import import_module\ndef __getattr__(n: str) -> object:\n"
                           "    return import_module(f'pkg.{n}')\n",
        "pkg/app.py": "import importlib\ndef f() -> None:\n    __import__('pkg.base')\n"
                      "    importlib.import_module('pkg.base')\n",
        "pkg/base.py": "def __getattr__(n: str) -> object:\n    return __import__(n)\n",  # not a package
    })
    assert hidden_imports(package) == [
        "pkg.app line 3: __import__(...)", "pkg.app line 4: import_module(...)", "pkg.base line 2: __import__(...)",
    ]


def test_modeldock_imports_nothing_by_computed_name() -> None:
    assert hidden_imports(PACKAGE) == []


def _tolerated(edge: Edge, floors: Floors) -> bool:
    return (floors.unit_of(edge.source), floors.unit_of(edge.target)) in ALLOWED_FOR_NOW


@pytest.fixture(scope="module")
def modeldock_floors() -> Floors:
    return parse_floors(DOC.read_text(), "modeldock")


@pytest.fixture(scope="module")
def modeldock_report(modeldock_floors: Floors) -> Report:
    return check(PACKAGE, modeldock_floors)


def test_modeldock_has_true_floors(modeldock_floors: Floors, modeldock_report: Report) -> None:
    floors, report = modeldock_floors, modeldock_report
    crossings = [(e, why) for e, why in report.crossings if not _tolerated(e, floors)]
    cycles = [c for c in report.module_cycles if tuple(c) not in CYCLES_FOR_NOW]
    new = Report(report.unplaced, report.empty_units, crossings, cycles, report.unit_cycles)
    problems = list(new.lines())
    assert problems == [], "import graph against docs/architecture.md:\n" + "\n".join(problems)


def test_importing_the_schema_loads_nothing_above_it(modeldock_floors: Floors) -> None:
    # The run-time view of the same rule, which also sees loads the static walk cannot (import_module).
    floors = modeldock_floors
    code = "import sys, modeldock.config; print(' '.join(m for m in sys.modules if m.startswith('modeldock')))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    names = done.stdout.split()
    # A package is loaded before its children: judge what it loads, not the package itself.
    loaded = {floors.unit_of(m) for m in names if not any(n.startswith(m + ".") for n in names)}
    schema = floors.floor_of["config"]
    above = sorted(str(u) for u in loaded
                   if u is None or (floors.floor_of[u] > schema and ("config", u) not in ALLOWED_FOR_NOW))
    assert above == [], f"import modeldock.config loads {above}"


def test_the_for_now_lists_hold_only_live_violations(modeldock_floors: Floors, modeldock_report: Report) -> None:
    floors, report = modeldock_floors, modeldock_report
    live = {(floors.unit_of(e.source), floors.unit_of(e.target)) for e, _ in report.crossings}
    stale = [f"{pair} ({owner})" for pair, owner in ALLOWED_FOR_NOW.items() if pair not in live]
    stale += [f"{cycle} ({owner})" for cycle, owner in CYCLES_FOR_NOW.items()
              if list(cycle) not in report.module_cycles]
    assert stale == [], "fixed, remove from the for-now lists: " + ", ".join(stale)


def test_every_room_has_a_readme_saying_what_it_owns() -> None:
    rooms = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    missing = [r for r in rooms if not (PACKAGE / r / "README.md").is_file() and r not in README_FOR_NOW]
    assert missing == [], f"rooms without a README.md: {missing}"
    stale = [r for r in README_FOR_NOW if (PACKAGE / r / "README.md").is_file() or r not in rooms]
    assert stale == [], f"written, remove from README_FOR_NOW: {stale}"
