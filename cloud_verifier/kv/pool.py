"""The paged KV cache of the target: one pool of fixed-size pages shared by every session, and the page
allocator over it (vLLM's PagedAttention, Kwon et al. 2023, "Efficient Memory Management for Large Language
Model Serving with PagedAttention").

- :class:`KVPool` holds the keys and values of all layers: ``tensor`` [num_layers, 2, num_pages, page_size,
  num_kv_heads, head_dim] (2 = keys, values), allocated once. Within a layer a page is contiguous and
  token-major ([page_size, num_kv_heads, head_dim], vLLM's flash layout), so the new keys of a forward pass are
  written with one ``index_copy_`` over flat slots (page * page_size + offset) and the keys of many pages are
  gathered with one ``index_select``.
- :class:`PagePool` hands out page ids (a free list) with a reference count per page.
- A session's KV cache is a page table (:class:`SessionKV`): growing appends pages
  (no copy), rolling back a rejected tail drops whole pages past the committed length, freeing drops them all.

Memory on the CPU: the pool is one private anonymous mapping; its memory pages take memory only once written, and
:meth:`KVPool.release_free` gives the memory of free KV pages back to the OS (``madvise(MADV_DONTNEED)``; the target
runner does it for the pages of a closed session, the reaper for all free pages when idle), so the resident size
returns to idle once the sessions are closed. On CUDA the pool is one ``torch.zeros`` allocation.
"""

from __future__ import annotations

import itertools
import math
import mmap
import threading
from collections.abc import Callable, Iterable

import torch

from specdec_runtime.common.errors import CapacityError


class PagePool:
    """Page ids 0..num_pages-1: a free list and a reference count per page.

    Contract of the prefix cache's hook ``on_release: Callable[[int], bool] | None``: it is called (under the
    pool's lock; it must not call back into the pool) with a page id whose reference count just dropped to 0.
    It returns True to keep the page out of the free list (cached: its contents stay valid, it counts in
    neither ``num_free`` nor ``num_used``; the cache later gives it back with :meth:`release_cached`, e.g.
    when evicting it LRU, or reuses it with :meth:`incref`), False to let it be freed now. With no hook every
    page at 0 references is freed.

    Thread-safe (one lock). Errors: :class:`~common.errors.CapacityError` when too few pages are free,
    ValueError on a reference count going below 0 or an unknown id.
    """

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"a page pool needs at least one page, not {num_pages}")
        self.num_pages = int(num_pages)
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._is_free = bytearray(b"\x01") * self.num_pages
        self._refs = [0] * self.num_pages
        self._num_cached = 0
        self._lock = threading.Lock()
        self.on_release: Callable[[int], bool] | None = None

    @property
    def num_free(self) -> int:
        """Pages in the free list."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Pages at 0 references kept by ``on_release`` (neither free nor used)."""
        return self._num_cached

    @property
    def num_used(self) -> int:
        """Pages with at least one reference."""
        return self.num_pages - len(self._free) - self._num_cached

    def refcount(self, page_id: int) -> int:
        return self._refs[page_id]

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh pages, each with one reference.

        Raises:
            CapacityError: fewer than ``n`` pages free (nothing is allocated).
        """
        n = int(n)
        with self._lock:
            if n > len(self._free):
                raise CapacityError(
                    f"KV cache full: {n} pages requested, {len(self._free)} of {self.num_pages} free"
                )
            ids = [self._free.pop() for _ in range(n)]
            for b in ids:
                self._refs[b] = 1
                self._is_free[b] = 0
        return ids

    def incref(self, ids: Iterable[int]) -> None:
        """One more reference to each page (a page at 0 references kept by ``on_release`` is used again)."""
        with self._lock:
            for b in ids:
                if self._refs[b] == 0:
                    if self._is_free[b]:
                        raise ValueError(f"page {b} is free: allocate it instead")
                    self._num_cached -= 1
                self._refs[b] += 1

    def decref(self, ids: Iterable[int]) -> None:
        """One reference less to each page; a page reaching 0 is offered to ``on_release``, else freed."""
        with self._lock:
            for b in ids:
                if self._refs[b] <= 0:
                    raise ValueError(f"page {b} has no reference to drop")
                self._refs[b] -= 1
                if self._refs[b] == 0:
                    if self.on_release is not None and self.on_release(b):
                        self._num_cached += 1
                    else:
                        self._free.append(b)
                        self._is_free[b] = 1

    free = decref

    def release_cached(self, ids: Iterable[int]) -> None:
        """Pages kept by ``on_release`` (at 0 references) go back to the free list (the cache evicted them)."""
        with self._lock:
            for b in ids:
                if self._refs[b] != 0 or self._is_free[b]:
                    raise ValueError(f"page {b} is not a cached page")
                self._num_cached -= 1
                self._free.append(b)
                self._is_free[b] = 1

    def free_ids(self) -> list[int]:
        """A snapshot of the free list."""
        with self._lock:
            return list(self._free)


class KVPool:
    """Keys and values of every layer in ``num_pages`` pages of ``page_size`` tokens, with its allocator.

    ``tensor``: [num_layers, 2, num_pages, page_size, num_kv_heads, head_dim] (zero-initialised: a padded
    read of a never-written page is finite, so masking it out leaves no NaN behind). ``pages``: the
    :class:`PagePool` over it.
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        if page_size < 1:
            raise ValueError(f"KV page size must be at least 1, not {page_size}")
        self.page_size = int(page_size)
        self.pages = PagePool(num_pages)
        shape = (num_layers, 2, int(num_pages), self.page_size, num_kv_heads, head_dim)
        self._mapping: mmap.mmap | None = None
        if device.type == "cpu":
            self.tensor = self._mapped_zeros(shape, dtype)
        else:
            self.tensor = torch.zeros(shape, dtype=dtype, device=device)

    def _mapped_zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero CPU tensor in its own private anonymous mapping: memory pages take memory only once written, and
        :meth:`release_free` can hand them back (malloc'd memory could not be given back page by page)."""
        count = math.prod(shape)
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        self._mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE)
        return torch.frombuffer(self._mapping, dtype=dtype, count=count).view(shape)

    @property
    def num_pages(self) -> int:
        return self.pages.num_pages

    def layer(self, layer: int, which: int) -> torch.Tensor:  # [num_pages * page_size, num_kv_heads, head_dim]
        """Keys (``which`` = 0) or values (1) of one layer as flat slots (a view of the pool)."""
        t = self.tensor[layer, which]
        return t.view(t.shape[0] * t.shape[1], t.shape[2], t.shape[3])

    def release_free(self, ids: list[int] | None = None) -> int:
        """Give the memory of free KV pages back to the OS (CPU pool; MADV_DONTNEED: memory read later is
        zero again): those of ``ids`` that are free, or every free page (None). Returns bytes released.

        Callers hold off forward passes meanwhile (the only writers of the pool): a page allocated between the
        free-list snapshot and the madvise has not been written yet, so losing its memory loses nothing.
        """
        if self._mapping is None or not hasattr(self._mapping, "madvise"):
            return 0
        free = self.pages.free_ids()
        if ids is not None:
            wanted = set(ids)
            free = [b for b in free if b in wanted]
        if not free:
            return 0
        free.sort()
        runs, begin, prev = [], free[0], free[0]
        for b in free[1:]:
            if b != prev + 1:
                runs.append((begin, prev + 1))
                begin = b
            prev = b
        runs.append((begin, prev + 1))
        os_page = mmap.PAGESIZE
        page_bytes = self.tensor[0, 0, 0].numel() * self.tensor.element_size()
        plane_bytes = page_bytes * self.num_pages  # one layer's keys (or values)
        released = 0
        for plane in range(self.tensor.shape[0] * 2):
            for lo, hi in runs:
                start = -(-(plane * plane_bytes + lo * page_bytes) // os_page) * os_page  # whole OS pages in the run
                end = (plane * plane_bytes + hi * page_bytes) // os_page * os_page
                if end > start:
                    self._mapping.madvise(mmap.MADV_DONTNEED, start, end - start)
                    released += end - start
        return released


class SessionKV:
    """KV cache of one session: a page table into the runner's :class:`~cloud_verifier.kv.pool.KVPool`.

    ``pages``: page ids in position order (position p is slot p % page_size of page pages[p // page_size]);
    the pages hold at least the positions written so far. ``capacity``: the most tokens the session may
    reach (prompt + max_new_tokens, capped by the context), tokens: a limit for validation, not memory; 0 once
    freed. Pages are added (:meth:`TargetRunner.ensure`), dropped (:meth:`TargetRunner.truncate`) and freed
    (:meth:`TargetRunner.free`) by the runner.

    Preemption (:mod:`cloud_verifier.kv.scheduler`): ``order`` ranks sessions by admission (lower = admitted
    earlier = higher priority; a preempted session keeps its rank). ``rebuild_from``: None while the table
    holds the KV of every position before the session's next row; after a preemption, the positions whose KV
    is still held (0 once its pages were dropped, more once a cached prefix was taken back): the next row
    first recomputes the positions from there (vLLM's recompute preemption). ``pending_ids``: the token ids of
    the positions an ExtendSession turn is prefilling (not committed yet), what a recomputation reads then.
    """

    _admitted = itertools.count()

    def __init__(self, capacity: int, pages: list[int] | None = None):
        self.capacity = int(capacity)
        self.pages: list[int] = [] if pages is None else pages
        self.freed = False
        self.order = next(SessionKV._admitted)
        self.rebuild_from: int | None = None
        self.pending_ids: list[int] | None = None  # an ExtendSession turn's history while it is prefilled
        self.recurrent = None  # hybrid targets: the conv / SSM states (cloud_verifier.kv.recurrent_state.SessionState)
