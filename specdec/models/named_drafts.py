"""The prepared drafts of the default target by name (``specdec bench --drafts int8,distilled,head``, and
``--draft NAME`` of generate, chat, edge-serve and bench: :func:`specdec.cli.checks.resolve_draft_option`), and the
one place that turns a draft directory into a drafter.

Three kinds of pair for the same target (docs/models.md, "The three kinds of pair"):

- ``int8``: the target itself quantized to int8 (``specdec models prepare``);
- ``distilled``: the committed 6-layer distilled draft (``specdec draft install``);
- ``head``: a draft head fed by the verifier's hidden states (:class:`edge_client.drafting.head.HeadDrafter`;
  ``specdec models prepare`` installs the shipped one).

A name that is not one of these is read as a directory: an ONNX draft, or a head (head.json) made by
``specdec models export-head``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from specdec_runtime.common.paths import (
    DRAFT_DIR_NAME, ONNX_FILE, ModelNotFoundError, default_cache_dir, resolve_draft_dir,
)

__all__ = ["DRAFT_NAMES", "HEAD_DIR_NAME", "HEAD_META", "drafter_for", "is_head_dir", "load_draft_model",
           "resolve_named_draft"]

HEAD_DIR_NAME = "smollm2-135m-instruct-head"  # where `specdec models prepare` installs the shipped head
HEAD_META = "head.json"  # what marks a converted head directory (specdec.models.head_export)


def _distilled_dir_name() -> str:
    from .distilled import DISTILLED_DRAFT_DIR_NAME

    return DISTILLED_DRAFT_DIR_NAME


# name -> (directory name under the model cache, the command that prepares it)
DRAFT_NAMES: dict[str, tuple[Any, str]] = {
    "int8": (lambda: DRAFT_DIR_NAME, "specdec models prepare"),
    "distilled": (_distilled_dir_name, "specdec draft install"),
    "head": (lambda: HEAD_DIR_NAME, "specdec models prepare"),
}


def is_head_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a converted draft head (its head.json)."""
    return (Path(path).expanduser() / HEAD_META).is_file()


def resolve_named_draft(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The directory of the draft called ``name``: a :data:`DRAFT_NAMES` key (looked up in ``cache_dir``,
    default: the model cache; a name wins over a directory of that name in the working directory: give ``./head``
    for that), or the path of an ONNX draft or a draft head directory.

    Raises:
        ModelNotFoundError: one line: the named draft is not prepared (naming the command that prepares it),
            ``name`` is neither a known name nor a directory (naming each name and the command that prepares it),
            or the directory holds neither an ONNX draft nor a head.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if name in DRAFT_NAMES:
        dir_name, command = DRAFT_NAMES[name]
        path = root / dir_name()
        if is_head_dir(path):
            return path.resolve()
        try:
            return resolve_draft_dir(path)
        except ModelNotFoundError:
            raise ModelNotFoundError(f"draft {name!r} is not prepared (no {path}): run `{command}`") from None
    path = Path(name).expanduser()
    if not path.is_dir() and not (path.is_file() and path.suffix == ".onnx"):  # model.onnx names its directory
        if "/" in name or os.sep in name:  # meant as a path: no list of names
            raise ModelNotFoundError(f"no ONNX draft ({ONNX_FILE}) or draft head ({HEAD_META}) at {name}: no such directory")
        known = ", ".join(f"{n} (`{command}`)" for n, (_, command) in DRAFT_NAMES.items())
        raise ModelNotFoundError(f"unknown draft {name!r}: give a draft directory or the name of a prepared draft: "
                                 f"{known}")
    if is_head_dir(path):
        return path.resolve()
    if path.is_dir() and not (path / ONNX_FILE).is_file():
        raise ModelNotFoundError(f"{name}: no ONNX draft ({ONNX_FILE}) and no draft head ({HEAD_META}) in this "
                                 "directory")
    return resolve_draft_dir(path)


def load_draft_model(draft_dir: str | os.PathLike, intra_op_num_threads: int | None = None) -> Any:
    """The model in ``draft_dir``: an :class:`edge_client.drafting.head_model.OnnxHead` when it holds a head,
    else an :class:`edge_client.drafting.onnx_draft.OnnxDraftModel`."""
    if is_head_dir(draft_dir):
        from specdec_runtime.edge_client.drafting.head_model import OnnxHead

        return OnnxHead(draft_dir, intra_op_num_threads=intra_op_num_threads)
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel

    return OnnxDraftModel(draft_dir, intra_op_num_threads=intra_op_num_threads)


def drafter_for(draft_model: Any, *, draft_top_k: int | None = None, valid_vocab_size: int | None = None,
                prefix_cache_mb: float = 0.0) -> Any:
    """The drafter that runs ``draft_model``: a :class:`edge_client.drafting.head.HeadDrafter` for a head (it
    drafts from the verifier's features), else a :class:`edge_client.drafting.drafter.ModelDrafter`."""
    from specdec_runtime.common.types import DEFAULT_DRAFT_TOP_K
    from specdec_runtime.edge_client.drafting.head_model import OnnxHead

    top_k = DEFAULT_DRAFT_TOP_K if draft_top_k is None else draft_top_k
    if isinstance(draft_model, OnnxHead):
        from specdec_runtime.edge_client.drafting.head import HeadDrafter

        return HeadDrafter(draft_model, draft_top_k=top_k)
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter

    return ModelDrafter(draft_model, draft_top_k=top_k, valid_vocab_size=valid_vocab_size,
                        prefix_cache_mb=prefix_cache_mb)
