"""The `routing:` section lives in picking/config.py and mounts without loading picking itself."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from modeldock.picking.config import SCORER_DEFAULTS, RoutingConfig
from modeldock.picking.registry import SCORERS


def test_the_ground_floor_schema_loads_no_picking_module_but_its_section() -> None:
    # A fresh interpreter: this one has long imported everything.
    code = ("import sys, modeldock.config; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('modeldock.picking'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["modeldock.picking", "modeldock.picking.config"]


def test_the_section_and_the_registry_name_the_same_scorers() -> None:
    assert list(SCORERS) == list(SCORER_DEFAULTS)
    assert all(SCORERS[n].weight == d.weight and SCORERS[n].load == d.load for n, d in SCORER_DEFAULTS.items())


def test_an_unknown_weight_is_an_error_naming_the_field() -> None:
    with pytest.raises(ValidationError) as err:
        RoutingConfig.model_validate({"weights": {"latency": 1.0}})
    assert err.value.errors()[0]["loc"] == ("weights",) and "latency" in str(err.value)
