"""Build hook: generate the gRPC stubs from protos/ on every build or install (see specdec/protogen.py)."""

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithProtos(build_py):
    def run(self):
        sys.path.insert(0, str(ROOT))
        try:
            from specdec.protogen import generate
        finally:
            sys.path.pop(0)
        generate(ROOT)  # into the source tree: serves editable installs
        super().run()  # copies common/v1/*_pb2*.py into the wheel for normal installs


setup(cmdclass={"build_py": BuildPyWithProtos})
