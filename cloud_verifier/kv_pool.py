"""The paged KV cache of the target: one pool of fixed-size blocks shared by every session, and the block
allocator over it (vLLM's PagedAttention, Kwon et al. 2023, "Efficient Memory Management for Large Language
Model Serving with PagedAttention").

- :class:`KVPool` holds the keys and values of all layers: ``tensor`` [num_layers, 2, num_blocks, block_size,
  num_kv_heads, head_dim] (2 = keys, values), allocated once. Within a layer a block is contiguous and
  token-major ([block_size, num_kv_heads, head_dim], vLLM's flash layout), so the new keys of a forward pass are
  written with one ``index_copy_`` over flat slots (block * block_size + offset) and the keys of many blocks are
  gathered with one ``index_select``.
- :class:`BlockPool` hands out block ids (a free list) with a reference count per block.
- A session's KV cache is a block table (:class:`cloud_verifier.target.SessionKV`): growing appends blocks
  (no copy), rolling back a rejected tail drops whole blocks past the committed length, freeing drops them all.

Memory on the CPU: the pool is one private anonymous mapping; its pages take memory only once written, and
:meth:`KVPool.release_free` gives the pages of free blocks back to the OS (``madvise(MADV_DONTNEED)``; the target
runner does it for the blocks of a closed session, the reaper for all free blocks when idle), so the resident size
returns to idle once the sessions are closed. On CUDA the pool is one ``torch.zeros`` allocation.
"""

from __future__ import annotations

import math
import mmap
import threading
from collections.abc import Callable, Iterable

import torch

from common.errors import CapacityError


class BlockPool:
    """Block ids 0..num_blocks-1: a free list and a reference count per block.

    Contract of the prefix cache's hook ``on_release: Callable[[int], bool] | None``: it is called (under the
    pool's lock; it must not call back into the pool) with a block id whose reference count just dropped to 0.
    It returns True to keep the block out of the free list (cached: its contents stay valid, it counts in
    neither ``num_free`` nor ``num_used``; the cache later gives it back with :meth:`release_cached`, e.g.
    when evicting it LRU, or reuses it with :meth:`incref`), False to let it be freed now. With no hook every
    block at 0 references is freed.

    Thread-safe (one lock). Errors: :class:`~common.errors.CapacityError` when too few blocks are free,
    ValueError on a reference count going below 0 or an unknown id.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, not {num_blocks}")
        self.num_blocks = int(num_blocks)
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._is_free = bytearray(b"\x01") * self.num_blocks
        self._refs = [0] * self.num_blocks
        self._num_cached = 0
        self._lock = threading.Lock()
        self.on_release: Callable[[int], bool] | None = None

    @property
    def num_free(self) -> int:
        """Blocks in the free list."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks at 0 references kept by ``on_release`` (neither free nor used)."""
        return self._num_cached

    @property
    def num_used(self) -> int:
        """Blocks with at least one reference."""
        return self.num_blocks - len(self._free) - self._num_cached

    def refcount(self, block_id: int) -> int:
        return self._refs[block_id]

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks, each with one reference.

        Raises:
            CapacityError: fewer than ``n`` blocks free (nothing is allocated).
        """
        n = int(n)
        with self._lock:
            if n > len(self._free):
                raise CapacityError(
                    f"KV cache full: {n} blocks requested, {len(self._free)} of {self.num_blocks} free"
                )
            ids = [self._free.pop() for _ in range(n)]
            for b in ids:
                self._refs[b] = 1
                self._is_free[b] = 0
        return ids

    def incref(self, ids: Iterable[int]) -> None:
        """One more reference to each block (a block at 0 references kept by ``on_release`` is used again)."""
        with self._lock:
            for b in ids:
                if self._refs[b] == 0:
                    if self._is_free[b]:
                        raise ValueError(f"block {b} is free: allocate it instead")
                    self._num_cached -= 1
                self._refs[b] += 1

    def decref(self, ids: Iterable[int]) -> None:
        """One reference less to each block; a block reaching 0 is offered to ``on_release``, else freed."""
        with self._lock:
            for b in ids:
                if self._refs[b] <= 0:
                    raise ValueError(f"block {b} has no reference to drop")
                self._refs[b] -= 1
                if self._refs[b] == 0:
                    if self.on_release is not None and self.on_release(b):
                        self._num_cached += 1
                    else:
                        self._free.append(b)
                        self._is_free[b] = 1

    free = decref

    def release_cached(self, ids: Iterable[int]) -> None:
        """Blocks kept by ``on_release`` (at 0 references) go back to the free list (the cache evicted them)."""
        with self._lock:
            for b in ids:
                if self._refs[b] != 0 or self._is_free[b]:
                    raise ValueError(f"block {b} is not a cached block")
                self._num_cached -= 1
                self._free.append(b)
                self._is_free[b] = 1

    def free_ids(self) -> list[int]:
        """A snapshot of the free list."""
        with self._lock:
            return list(self._free)


class KVPool:
    """Keys and values of every layer in ``num_blocks`` blocks of ``block_size`` tokens, with its allocator.

    ``tensor``: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] (zero-initialised: a padded
    read of a never-written block is finite, so masking it out leaves no NaN behind). ``blocks``: the
    :class:`BlockPool` over it.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        if block_size < 1:
            raise ValueError(f"KV block size must be at least 1, not {block_size}")
        self.block_size = int(block_size)
        self.blocks = BlockPool(num_blocks)
        shape = (num_layers, 2, int(num_blocks), self.block_size, num_kv_heads, head_dim)
        self._mapping: mmap.mmap | None = None
        if device.type == "cpu":
            self.tensor = self._mapped_zeros(shape, dtype)
        else:
            self.tensor = torch.zeros(shape, dtype=dtype, device=device)

    def _mapped_zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero CPU tensor in its own private anonymous mapping: pages take memory only once written, and
        :meth:`release_free` can hand them back (malloc'd memory could not be given back block by block)."""
        count = math.prod(shape)
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        self._mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE)
        return torch.frombuffer(self._mapping, dtype=dtype, count=count).view(shape)

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    def layer(self, layer: int, which: int) -> torch.Tensor:  # [num_blocks * block_size, num_kv_heads, head_dim]
        """Keys (``which`` = 0) or values (1) of one layer as flat slots (a view of the pool)."""
        t = self.tensor[layer, which]
        return t.view(t.shape[0] * t.shape[1], t.shape[2], t.shape[3])

    def release_free(self, ids: list[int] | None = None) -> int:
        """Give the memory pages of free blocks back to the OS (CPU pool; MADV_DONTNEED: a page read later is
        zero again): those of ``ids`` that are free, or every free block (None). Returns bytes released.

        Callers hold off forward passes meanwhile (the only writers of the pool): a block allocated between the
        free-list snapshot and the madvise has not been written yet, so losing its pages loses nothing.
        """
        if self._mapping is None or not hasattr(self._mapping, "madvise"):
            return 0
        free = self.blocks.free_ids()
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
        page = mmap.PAGESIZE
        block_bytes = self.tensor[0, 0, 0].numel() * self.tensor.element_size()
        plane_bytes = block_bytes * self.num_blocks  # one layer's keys (or values)
        released = 0
        for plane in range(self.tensor.shape[0] * 2):
            for lo, hi in runs:
                start = -(-(plane * plane_bytes + lo * block_bytes) // page) * page  # whole pages inside the run
                end = (plane * plane_bytes + hi * block_bytes) // page * page
                if end > start:
                    self._mapping.madvise(mmap.MADV_DONTNEED, start, end - start)
                    released += end - start
        return released
