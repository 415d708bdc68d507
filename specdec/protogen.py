"""Generate the gRPC/protobuf stubs of ``protos/common/v1/*.proto`` into ``common/v1/``.

This is the one build step that produces stubs (they are never committed nor edited by hand). The stubs'
Python package follows the proto's path under ``protos/`` (``common/v1/verifier.proto`` -> ``common.v1``): the
runtime's own package, so edge_client/ and cloud_verifier/ never import the tooling package for them. The proto
package inside the file stays ``specdec.v1`` (the service's full name on the wire, ``specdec.v1.Verifier``).
It runs from ``setup.py`` on every install/build (``pip install .`` and ``pip install -e .``)
and from ``make proto``; ``python -m specdec.protogen`` runs it by hand.

Raises:
    RuntimeError: when ``grpc_tools.protoc`` fails (its message is included).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
STUBS_PACKAGE = Path("common", "v1")  # where the generated modules land, relative to the output root


def generate(root: Path = ROOT, out_dir: Path | None = None) -> list[Path]:
    """Run protoc on every ``.proto`` under ``root/protos``; return the generated files."""
    from grpc_tools import protoc  # build-time dependency (pyproject build-system.requires)
    import importlib.resources

    proto_dir = root / "protos"
    out = out_dir or root
    protos = sorted(str(p.relative_to(proto_dir)) for p in proto_dir.rglob("*.proto"))
    if not protos:
        raise RuntimeError(f"no .proto files under {proto_dir}")
    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{proto_dir}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *protos,
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"grpc_tools.protoc failed with exit code {rc}: {' '.join(args)}")
    return sorted((out / STUBS_PACKAGE).glob("*_pb2*.py*"))


if __name__ == "__main__":
    for path in generate():
        print(path)
    sys.exit(0)
