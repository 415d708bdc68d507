"""Build hook: generate the gRPC stubs from protos/ on every build or install (see specdec/protogen.py), and map the
runtime's folders into its own import namespace.

The folders common/, edge_client/ and cloud_verifier/ stay at the top of the repository (docs/architecture.md) but
install as ``specdec_runtime.common``, ``specdec_runtime.edge_client`` and ``specdec_runtime.cloud_verifier``: bare
top-level names such as ``common`` are shadowed by an app's own package of that name (and PyPI has one), so an SDK
that imports them is not safe to embed. ``specdec_runtime`` itself is a namespace package (no folder of its own).
"""

import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
RUNTIME_NAMESPACE = "specdec_runtime"
RUNTIME_FOLDERS = ("common", "edge_client", "cloud_verifier")


class BuildPyWithProtos(build_py):
    def run(self):
        sys.path.insert(0, str(ROOT))
        try:
            from specdec.protogen import generate
        finally:
            sys.path.pop(0)
        generate(ROOT)  # into the source tree: serves editable installs
        super().run()  # copies common/v1/*_pb2*.py into the wheel for normal installs


def _packages() -> list[str]:
    runtime = [f"{RUNTIME_NAMESPACE}.{name}" for name in find_packages(include=[f"{f}*" for f in RUNTIME_FOLDERS])]
    return find_packages(include=["specdec", "specdec.*"]) + runtime


setup(
    cmdclass={"build_py": BuildPyWithProtos},
    packages=_packages(),
    package_dir={f"{RUNTIME_NAMESPACE}.{folder}": folder for folder in RUNTIME_FOLDERS},
)
