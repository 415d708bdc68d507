"""Import this first to run as an edge install would (``pip install 'specdec-edgecloud[edge]'``): the packages only the
verifier and the tools need cannot be imported (ModuleNotFoundError, as when they are not installed), nor can the
cloud side's own package. Used by tests that run the edge in a subprocess (tests/e2e/test_edge_install.py).

    python -c "import _edge_only; from specdec.cli import app; app()" generate --server H:P ...
"""

from __future__ import annotations

import importlib.abc
import sys

# what specdec-edgecloud[verifier] and specdec-edgecloud[tools] add to the core (pyproject.toml), and the verifier's package
BLOCKED = frozenset({
    "torch", "transformers", "safetensors", "redis", "prometheus_client", "pydantic_settings", "grpc_reflection",
    "gguf", "accelerate", "onnx", "onnxscript", "tqdm", "rich", "grpc_tools", "cloud_verifier",
})


def root(module: str) -> str:
    """The package a module belongs to: its top-level name, or the runtime folder under ``specdec_runtime``."""
    return module.removeprefix("specdec_runtime.").split(".", 1)[0]


class _Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if root(fullname) in BLOCKED:
            raise ModuleNotFoundError(f"No module named {fullname!r} (blocked: an edge install)", name=fullname)
        return None


def install() -> None:
    """Block the modules (idempotent); any of them already imported is an error (it would be used as is)."""
    loaded = sorted(m for m in sys.modules if root(m) in BLOCKED)
    if loaded:
        raise RuntimeError(f"already imported, cannot be blocked: {loaded}")
    if not any(isinstance(f, _Blocker) for f in sys.meta_path):
        sys.meta_path.insert(0, _Blocker())


install()
