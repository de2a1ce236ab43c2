"""The ground-floor schema mounts `queue:` without loading flow control or Prometheus."""

from __future__ import annotations

import subprocess
import sys


def test_the_config_schema_loads_only_the_queue_section_of_flow_control() -> None:
    # A fresh interpreter: this one has long imported everything.
    code = ("import sys, modeldock.config; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith(('modeldock.flowcontrol', "
            "'prometheus_client')))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["modeldock.flowcontrol", "modeldock.flowcontrol.config"]


def test_the_package_names_still_load_on_first_use() -> None:
    import modeldock.flowcontrol as fc

    assert fc.FlowQueue.__module__ == "modeldock.flowcontrol.queue" and fc.Waiting.__name__ == "Waiting"
