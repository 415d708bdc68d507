"""Every verifier entry point sets OMP_WAIT_POLICY=PASSIVE before torch is imported (torch reads it once; with the
active default each small CPU op cost ~15 ms on a loaded box): the server module at import, so a program calling
its ``serve`` gets it too, and the CLI (``specdec serve``, what deploy/ starts). A value the user set wins.

Each entry module is imported in a fresh interpreter with an import hook that records the variable at the moment
torch is first imported (the module's own imports included); no model is loaded."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

PROBE = """
import importlib, importlib.abc, os, sys
seen = []
class Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" and not seen:
            seen.append(os.environ.get("OMP_WAIT_POLICY", "<unset>"))
sys.meta_path.insert(0, Hook())
importlib.import_module(sys.argv[1])
import torch
print(seen[0])
"""

ENTRIES = ["specdec_runtime.cloud_verifier.serving.server", "specdec.cli"]  # serve(settings) from Python; specdec serve (Docker, k8s)


def _probe(module: str, **env) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}  # conftest set it for this process
    out = subprocess.run([sys.executable, "-c", PROBE, module], env={**base, **env}, capture_output=True,
                         text=True, timeout=100, check=True)
    return out.stdout.split()


@pytest.mark.parametrize("module", ENTRIES)
def test_entry_point_sets_passive_before_torch(module):
    assert _probe(module)[0] == "PASSIVE"


def test_a_value_the_user_set_wins():
    assert _probe("specdec_runtime.cloud_verifier.serving.server", OMP_WAIT_POLICY="ACTIVE")[0] == "ACTIVE"


def test_python_m_cloud_verifier_server_points_to_specdec_serve():
    # the runtime has no command line (it would import the tooling's): one line naming the one that exists
    out = subprocess.run([sys.executable, "-m", "specdec_runtime.cloud_verifier.serving.server", "--help"], capture_output=True, text=True,
                         timeout=100)
    assert out.returncode == 1 and out.stdout == ""
    assert "specdec serve" in out.stderr and len(out.stderr.strip().splitlines()) == 1
