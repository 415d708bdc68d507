"""Generate the gRPC/protobuf stubs of ``protos/common/v1/*.proto`` into ``common/v1/``.

This is the one build step that produces stubs (they are never committed nor edited by hand). protoc names the
stubs' Python package after the proto's path under its include root, so the protos are staged under
``specdec_runtime/`` in a temporary root first: the stubs import each other as ``specdec_runtime.common.v1``, the
runtime's own namespace (the folder ``common/`` is installed as ``specdec_runtime.common``), and edge_client/ and
cloud_verifier/ never import the tooling package for them. The proto package inside the file stays ``specdec.v1``
(the service's full name on the wire, ``specdec.v1.Verifier``).
It runs from ``setup.py`` on every install/build (``pip install .`` and ``pip install -e .``)
and from ``make proto``; ``python -m specdec.protogen`` runs it by hand.

Raises:
    RuntimeError: when ``grpc_tools.protoc`` fails (its message is included).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNTIME_NAMESPACE = "specdec_runtime"  # the import namespace of common/, edge_client/, cloud_verifier/


def generate(root: Path = ROOT, out_dir: Path | None = None) -> list[Path]:
    """Run protoc on every ``.proto`` under ``root/protos``; return the generated files."""
    from grpc_tools import protoc  # build-time dependency (pyproject build-system.requires)
    import importlib.resources

    proto_dir = root / "protos"
    out = out_dir or root
    protos = sorted(p.relative_to(proto_dir) for p in proto_dir.rglob("*.proto"))
    if not protos:
        raise RuntimeError(f"no .proto files under {proto_dir}")
    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        staged, generated = Path(tmp, "in"), Path(tmp, "out")
        for rel in protos:
            (staged / RUNTIME_NAMESPACE / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(proto_dir / rel, staged / RUNTIME_NAMESPACE / rel)
        generated.mkdir()
        args = [
            "grpc_tools.protoc",
            f"-I{staged}",
            f"-I{well_known}",
            f"--python_out={generated}",
            f"--pyi_out={generated}",
            f"--grpc_python_out={generated}",
            *(str(Path(RUNTIME_NAMESPACE, rel)) for rel in protos),
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"grpc_tools.protoc failed with exit code {rc}: {' '.join(args)}")
        written = []
        for stub in sorted((generated / RUNTIME_NAMESPACE).rglob("*_pb2*.py*")):
            target = out / stub.relative_to(generated / RUNTIME_NAMESPACE)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(stub, target)
            written.append(target)
    return written


if __name__ == "__main__":
    for path in generate():
        print(path)
    sys.exit(0)
