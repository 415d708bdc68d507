"""A client's delivered draft: fetched from its verifier at connect, and replaced by a newer version only between
generations.

:class:`DeliveredDraft` remembers the source, the cache and the version in use. :meth:`DeliveredDraft.refresh`
runs at the start of a generation (:meth:`edge_client.client.EdgeClient.stream_chunks`, before any token), at most
once per ``check_interval_s``: it asks which version to use (ResolveDraft) and, when it is another one, fetches
it, loads it and swaps the client's drafter and tokenizer. A generation in progress keeps the objects it started
with, so a version never changes in the middle of one. A failed check (verifier unreachable, fetch refused) keeps
the version in use and is logged; the generation's own calls report the verifier's state.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from specdec_runtime.common.draft_manifest import TOKENIZER_FILES, DraftManifest
from specdec_runtime.common.errors import SpecdecError
from specdec_runtime.edge_client.delivery.cache import DraftCache
from specdec_runtime.edge_client.delivery.fetch import DraftSource, FetchReport, Progress, ensure_draft

log = logging.getLogger(__name__)


@dataclass
class DraftParts:
    """What a delivered version gives the client: the drafter (None: tokenizer only), the tokenizer, the
    manifest and what fetching it took."""

    drafter: object | None
    tokenizer: object
    manifest: DraftManifest
    report: FetchReport


@dataclass
class DeliveredDraft:
    """The delivered draft of one client (see the module docstring).

    Args:
        source: the verifier's delivery RPCs. cache: where versions are kept.
        name: the draft asked for ("" = the verifier's default).
        tokenizer_only: fetch and load only the tokenizer files (the cloud route: no draft runs here).
        draft_top_k, prefix_cache_mb: :class:`edge_client.drafting.drafter.ModelDrafter` settings.
        check_interval_s: ask for a newer version at most this often, s (0 = before every generation).
        progress: called per chunk written (:data:`edge_client.delivery.fetch.Progress`).
    """

    source: DraftSource
    cache: DraftCache
    name: str = ""
    tokenizer_only: bool = False
    draft_top_k: int = 0
    prefix_cache_mb: float = 0.0
    check_interval_s: float = 60.0
    progress: Progress | None = None
    manifest: DraftManifest | None = None
    last_report: FetchReport | None = None
    # the verifier's last word on the version in use: why it is quarantined ("" = it is not); while set, the
    # client runs new generations on the cloud route
    quarantine_reason: str = ""
    _next_check: float = field(default=0.0, repr=False)

    def load(self, manifest: DraftManifest | None = None) -> DraftParts:
        """Fetch (when not cached) and load ``manifest`` (None: the one the verifier names now).

        Raises:
            SpecdecError: the verifier's answer (NOT_FOUND, UNAUTHENTICATED, UNAVAILABLE) or a file still wrong
                after its retries or a malformed manifest (DraftIntegrityError).
            ModelNotFoundError: the delivered folder is not a loadable draft.
        """
        only = None
        if self.tokenizer_only:
            manifest = manifest or self.source.resolve(self.name)
            only = [f.path for f in manifest.files if Path(f.path).name in TOKENIZER_FILES]
        report = ensure_draft(self.source, self.cache, name=self.name, manifest=manifest, only=only,
                              progress=self.progress)
        self.quarantine_reason = report.manifest.quarantine_reason
        parts = _load_parts(report, self.tokenizer_only, self.draft_top_k, self.prefix_cache_mb)
        self.manifest, self.last_report = report.manifest, report
        self._next_check = time.monotonic() + self.check_interval_s
        return parts

    def refresh(self) -> DraftParts | None:
        """The parts of a newer version when the verifier names one (fetched and loaded), else None; at most one
        check per ``check_interval_s``. Never raises: a failed check keeps the version in use (logged)."""
        now = time.monotonic()
        if now < self._next_check:
            return None
        self._next_check = now + self.check_interval_s
        try:
            wanted = self.source.resolve(self.name)
            if self.manifest is not None and (wanted.label, wanted.digest) == (self.manifest.label,
                                                                               self.manifest.digest):
                if wanted.quarantine_reason != self.quarantine_reason:
                    why = wanted.quarantine_reason
                    log.warning("draft %s %s", wanted.label, f"quarantined by the verifier ({why}): new generations "
                                "on the cloud route" if why else "out of quarantine")
                self.quarantine_reason = wanted.quarantine_reason
                return None  # (another version of the same files is still another version: its own counts)
            parts = self.load(wanted)
        except (SpecdecError, ValueError, OSError) as e:  # ModelNotFoundError is a ValueError
            log.warning("draft update check failed, keeping %s: %s",
                        self.manifest.label if self.manifest else "no draft", e)
            return None
        log.info("draft %s -> %s (next generation on)", self.manifest.label if self.manifest else "none",
                 parts.manifest.label)
        return parts

    def close(self) -> None:
        self.source.close()


def _load_parts(report: FetchReport, tokenizer_only: bool, draft_top_k: int, prefix_cache_mb: float) -> DraftParts:
    """The drafter and tokenizer of a fetched version's folder: a ModelDrafter over an ONNX draft (kind "onnx"),
    a HeadDrafter over a draft head (kind "head").

    Raises:
        ModelNotFoundError: the folder is not a loadable draft of its kind."""
    from specdec_runtime.common.paths import resolve_draft_dir

    if tokenizer_only:
        from specdec_runtime.edge_client.drafting.tokenizer import load_tokenizer

        return DraftParts(None, load_tokenizer(report.folder), report.manifest, report)
    if report.manifest.kind == "head":  # a draft head: drafts from the verifier's features
        from specdec_runtime.edge_client.drafting.head import HeadDrafter
        from specdec_runtime.edge_client.drafting.head_model import OnnxHead

        head = OnnxHead(report.folder)
        return DraftParts(HeadDrafter(head, draft_top_k=draft_top_k), head.tokenizer, report.manifest, report)
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel

    model = OnnxDraftModel(resolve_draft_dir(report.folder))
    drafter = ModelDrafter(model, draft_top_k=draft_top_k, prefix_cache_mb=prefix_cache_mb)
    return DraftParts(drafter, model.tokenizer, report.manifest, report)
