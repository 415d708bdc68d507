"""The trained draft head of the default target: installed from its committed artefact
(``drafts/smollm2-135m-instruct-head``: an EAGLE-3 checkpoint in float16, what the head does not share with the
target) into ``<cache>/smollm2-135m-instruct-head``, the device's ONNX head (:func:`specdec.models.head_export.
export_head`), which the edge selects by the name ``head``.

The artefact's ``config.json`` records the sha256 of the embedding of the target it was trained for
(``target_embedding_sha256``): :func:`install_head` refuses any other target in one line before exporting. The
install's marker records the sha256 of the artefact's weights and the export's version, so a new artefact (or a
new export) replaces an older install instead of being shadowed by it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from specdec_runtime.common.paths import default_model_paths, is_complete

from ._util import atomic_dir, write_marker
from .head_export import HeadMismatchError, embedding_sha256, export_head

__all__ = ["HEAD_DIR_NAME", "default_head_artefact_dir", "install_head", "prepare_head", "check_head_target"]

HEAD_DIR_NAME = "smollm2-135m-instruct-head"
# what an install holds beyond the artefact: 2 = the embedding in float16 (specdec.models.head_graph)
EXPORT_VERSION = 2


def default_head_artefact_dir() -> Path:
    """The committed artefact of the default target's head (``<repo>/drafts/smollm2-135m-instruct-head``)."""
    return Path(__file__).resolve().parents[2] / "drafts" / HEAD_DIR_NAME


def check_head_target(target_dir: str | os.PathLike, artefact_dir: str | os.PathLike) -> None:
    """Raise HeadMismatchError (one line) unless the artefact was trained for the target in ``target_dir``
    (same embedding sha256; an artefact that records none is checked by :func:`export_head`'s widths only)."""
    from safetensors import safe_open

    want = json.loads((Path(artefact_dir) / "config.json").read_text()).get("target_embedding_sha256")
    if not want:
        return
    files = sorted(Path(target_dir).glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), "pt") as st:
            name = next((k for k in st.keys() if k.endswith("embed_tokens.weight")), None)
            if name is not None:
                if embedding_sha256(st.get_tensor(name)) != want:
                    raise HeadMismatchError(f"the head in {artefact_dir} was trained for another target "
                                            f"(its embedding's sha256 differs from {target_dir}'s)")
                return
    raise HeadMismatchError(f"{target_dir}: no embed_tokens.weight to check the head against")


def install_head(target_dir: str | os.PathLike, artefact_dir: str | os.PathLike, out_dir: str | os.PathLike,
                 force: bool = False) -> Path:
    """Convert the committed head artefact for the target into ``out_dir`` (idempotent unless ``force``).

    Raises:
        HeadMismatchError: the artefact was trained for another target (one line)."""
    out_dir = Path(out_dir)
    stamp = {"artefact_sha256": _weights_sha256(Path(artefact_dir)), "export_version": EXPORT_VERSION}
    if is_complete(out_dir) and not force and _installed_stamp(out_dir) == stamp:
        return out_dir
    check_head_target(target_dir, artefact_dir)
    with atomic_dir(out_dir, True) as tmp:  # an older install of another artefact or export is replaced
        export_head(target_dir, artefact_dir, tmp)
        write_marker(tmp, {"artefact": str(artefact_dir), "kind": "head", **stamp})
    return out_dir


def _weights_sha256(artefact_dir: Path) -> str:
    digest = hashlib.sha256()
    with (artefact_dir / "model.safetensors").open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _installed_stamp(out_dir: Path) -> dict:
    """The artefact sha256 and export version an install's marker records ({} for an install without them)."""
    from specdec_runtime.common.paths import COMPLETE_MARKER

    try:
        marker = json.loads((out_dir / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return {k: marker.get(k) for k in ("artefact_sha256", "export_version")}


def prepare_head(cache_dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Install the default target's committed head at ``<cache>/smollm2-135m-instruct-head`` (the target must
    be prepared: :func:`specdec.models.prepare_models`)."""
    paths = default_model_paths(cache_dir)
    return install_head(paths.target_dir, default_head_artefact_dir(), paths.target_dir.parent / HEAD_DIR_NAME,
                        force=force)
