"""Drafts delivered by the verifier: asking which one to use, downloading it checked into a cache, taking a new
version between generations (:mod:`.fetch`, :mod:`.cache`, :mod:`.updater`)."""

from __future__ import annotations

import os
from typing import Sequence

from specdec_runtime.common.errors import VerifierUnavailableError
from specdec_runtime.edge_client.delivery.cache import DraftCache
from specdec_runtime.edge_client.delivery.fetch import DraftSource, Progress
from specdec_runtime.edge_client.delivery.updater import DeliveredDraft, DraftParts
from specdec_runtime.edge_client.transport.connections import parse_addresses
from specdec_runtime.edge_client.transport.credentials import ChannelSecurity

__all__ = ["DeliveredDraft", "DraftCache", "DraftParts", "DraftSource", "connect_delivery"]


def connect_delivery(address: str | Sequence[str], security: ChannelSecurity, *, name: str = "",
                     cache_dir: str | os.PathLike | None = None, tokenizer_only: bool = False, draft_top_k: int = 0,
                     prefix_cache_mb: float = 0.0, check_interval_s: float = 60.0,
                     progress: Progress | None = None) -> tuple[DeliveredDraft, DraftParts]:
    """The draft the verifiers at ``address`` name, fetched (once: cached) and loaded; the first address that
    answers serves it. Arguments as :class:`DeliveredDraft`.

    Raises:
        VerifierUnavailableError: no address answers. Other errors as :meth:`DeliveredDraft.load`.
    """
    last: Exception | None = None
    for one in parse_addresses(address):
        source = DraftSource(one, security)
        delivered = DeliveredDraft(source, DraftCache(cache_dir), name=name, tokenizer_only=tokenizer_only,
                                   draft_top_k=draft_top_k, prefix_cache_mb=prefix_cache_mb,
                                   check_interval_s=check_interval_s, progress=progress)
        try:
            return delivered, delivered.load()
        except VerifierUnavailableError as e:
            source.close()
            last = e
        except BaseException:
            source.close()
            raise
    raise last if last is not None else VerifierUnavailableError("no verifier address")
