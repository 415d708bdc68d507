"""The public API, ``specdec``'s front door: every name of ``__all__`` resolves to the object its home module
defines, is documented, and the edge names import on a slim edge install (no torch, no transformers: the
subprocess blocks them as tests/_edge_only.py does), where a cloud name says which extra to install."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import specdec

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
CLOUD = ("Verifier", "TargetRunner", "VerifierSettings", "EmbeddedServer", "LocalBackend")


def _edge_only(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}
    return subprocess.run([sys.executable, "-c", "import _edge_only, sys, json\n" + code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_edge_names_import_without_torch():
    edge = [n for n in specdec.__all__ if n not in CLOUD]
    proc = _edge_only(
        "import specdec\nfrom specdec import EdgeClient\n"
        f"for name in {edge!r}: getattr(specdec, name)\n"
        "print(json.dumps(sorted({_edge_only.root(m) for m in sys.modules})))")
    assert proc.returncode == 0, proc.stderr
    modules = set(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert not modules & {"torch", "transformers", "cloud_verifier"}, modules & {"torch", "transformers"}


def test_import_specdec_alone_imports_nothing_heavy():
    proc = _edge_only("import specdec\nprint(json.dumps(sorted({_edge_only.root(m) for m in sys.modules})))")
    assert proc.returncode == 0, proc.stderr
    modules = set(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert not modules & {"edge_client", "onnxruntime", "grpc", "numpy"}, modules  # lazy: nothing until used


@pytest.mark.parametrize("name", CLOUD)
def test_cloud_name_on_edge_install_names_the_extra(name):
    proc = _edge_only(f"from specdec import {name}")
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: ") and "specdec-edgecloud[verifier]" in last, last
    assert "pip install -e '.[verifier]' in a clone" in last and "pip install 'specdec" not in last, last


@pytest.mark.parametrize("name", [n for n in specdec.__all__ if n != "__version__"])
def test_public_name_is_its_home_object_and_documented(name):
    obj = getattr(specdec, name)
    assert getattr(sys.modules[obj.__module__], name) is obj  # defined where it says, not a copy
    assert inspect.getdoc(obj), f"specdec.{name} has no docstring"
    assert name in dir(specdec)


def test_unknown_name_is_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        specdec.Nope  # noqa: B018
    from importlib.metadata import version

    assert specdec.__version__ == version("specdec-edgecloud")  # the distribution's, not PyPI's "specdec"
