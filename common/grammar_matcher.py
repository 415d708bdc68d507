"""One session's grammar state (:class:`GrammarMatcher`): token masks, masks along a draft block, forced tokens,
roll-back. Built by :meth:`common.grammar.CompiledGrammar.matcher`.

The matcher has consumed the session's generated ids that are committed (or, on the edge, committed + drafted so
far). Under speculation it is advanced along a block only to compute the block's masks and rolled back at once;
it moves for good with a commit (:meth:`advance`), as vLLM does with its structured-output spec decode
(validate the draft without keeping the state).
"""

from __future__ import annotations

import numpy as np

__all__ = ["GrammarMatcher"]


class GrammarMatcher:
    """The parser state of one session's output under one grammar (not thread-safe: one per session).

    Attributes:
        vocab_size: ids the tokenizer knows (masks are wider when the logits are padded: the extra ids are False).
        spec: the :class:`common.grammar.GrammarSpec` it was compiled from.
    """

    def __init__(self, engine_matcher, vocab_size: int, spec, eos_token_ids=()) -> None:
        self._m = engine_matcher
        self._eos = frozenset(int(i) for i in eos_token_ids)
        self.vocab_size = int(vocab_size)
        self.spec = spec
        self._words = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)  # the engine's bitmask buffer
        self._ids: list[int] = []  # the ids consumed, in order (EOS included)
        # EOS is consumed here, not by the engine: llguidance 1.9 does not roll an EOS back cleanly (the state
        # after rollback(1) refuses EOS again), and under speculation an EOS is often rolled back
        self._ended = False

    # ------------------------------------------------------------------ state
    @property
    def num_tokens(self) -> int:
        """Ids consumed since the grammar started (the generated ids it has seen)."""
        return len(self._ids)

    @property
    def is_finished(self) -> bool:
        """The grammar can go no further (only EOS is allowed next, or EOS was consumed)."""
        return self._ended or bool(self._m.is_stopped())

    @property
    def has_ended(self) -> bool:
        """An EOS id was consumed: nothing can follow."""
        return self._ended

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete match (EOS allowed)."""
        return bool(self._m.is_accepting())

    def checkpoint(self) -> int:
        """A state to :meth:`restore` (the number of ids consumed), like StopChecker.checkpoint."""
        return len(self._ids)

    def restore(self, state: int) -> None:
        """Back to a :meth:`checkpoint` (rolls back what was consumed since)."""
        self.rollback(len(self._ids) - state)

    def rollback(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` consumed ids. Raises ValueError: more than consumed."""
        if num_tokens < 0 or num_tokens > len(self._ids):
            raise ValueError(f"cannot roll back {num_tokens} of {len(self._ids)} grammar tokens")
        if num_tokens:
            del self._ids[len(self._ids) - num_tokens:]
        if num_tokens and self._ended:
            self._ended, num_tokens = False, num_tokens - 1
        if num_tokens:
            self._m.rollback(num_tokens)

    def advance(self, token_ids) -> None:
        """Consume ``token_ids`` (committed output ids), all or none.

        Raises:
            ValueError: the grammar forbids one of them (the state is left as before the call).
        """
        ids = [int(t) for t in token_ids]
        ok = self._consume(ids)
        if ok < len(ids):
            self.rollback(ok)
            if self._m.is_error():
                raise ValueError(f"grammar engine error: {self._m.get_error()}")
            raise ValueError(f"grammar {self.spec.kind} forbids token {ids[ok]} at output position "
                             f"{len(self._ids) + ok}")

    def _consume(self, ids: list[int]) -> int:
        """Consume the longest allowed prefix of ``ids``; returns its length. An EOS id is taken here (allowed
        once the grammar accepts; nothing after it), never by the engine, which keeps out of its error state."""
        done, eos = 0, self._eos
        while done < len(ids) and not self._ended:
            if ids[done] in eos:
                if not self._m.is_accepting():
                    break
                self._ended = True
                done += 1
                self._ids.append(ids[done - 1])
                break
            end = next((j for j in range(done, len(ids)) if ids[j] in eos), len(ids))
            n = int(self._m.try_consume_tokens(ids[done:end]))
            self._ids.extend(ids[done:done + n])
            done += n
            if done < end:
                break
        return done

    def replay(self, token_ids) -> None:
        """Reset to the grammar's start and consume ``token_ids`` (a session resumed on another replica).

        Raises ValueError: the ids do not match the grammar (the matcher is then at the start)."""
        self._m.reset()
        self._ids, self._ended = [], False
        self.advance(token_ids)

    def sync(self, token_ids) -> None:
        """Bring the matcher to ``token_ids`` (the output ids so far): roll back to the longest common prefix with
        what it has consumed, then advance by the rest (O(changed ids) when a block was accepted or rolled back).

        Raises ValueError: the grammar forbids one of the new ids (the matcher is then at the common prefix)."""
        ids = [int(t) for t in token_ids]
        have = self._ids
        keep = min(len(have), len(ids))
        if have[:keep] != ids[:keep]:
            keep = next(i for i in range(keep) if have[i] != ids[i])
        self.rollback(len(have) - keep)
        self.advance(ids[keep:])

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def token_ids(self) -> list[int]:
        """The ids consumed (a copy)."""
        return list(self._ids)

    def num_valid(self, token_ids) -> int:
        """How many leading ids of ``token_ids`` the masks allow, from the current state (state unchanged).

        By the masks, not the engine's consume check, which is looser where a string is forced (the mask then
        allows its canonical tokenization only, a looser check also a split of it)."""
        ids = [int(t) for t in token_ids]
        masks = self.block_masks(ids)
        return next((i for i, t in enumerate(ids) if t >= masks.shape[1] or not masks[i][t]), len(ids))

    # ------------------------------------------------------------------ masks
    def _fill(self) -> np.ndarray:  # [ceil(vocab_size / 32)] int32, bit j of word i = id 32 i + j allowed
        w = self._words
        if self._ended:  # after EOS: EOS again (a row that is never used, but must not be all −inf)
            w[:] = 0
            for t in self._eos:
                w[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
            return w
        self._m.unsafe_compute_mask_ptr(w.ctypes.data, w.nbytes)
        if self._m.is_error():
            raise ValueError(f"grammar engine error: {self._m.get_error()}")
        return w

    def _bool(self, words: np.ndarray, width: int) -> np.ndarray:  # [width] bool
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:min(width, self.vocab_size)]
        if width > bits.size:
            bits = np.concatenate([bits, np.zeros(width - bits.size, dtype=np.uint8)])
        return bits.astype(bool)

    def mask(self, width: int | None = None) -> np.ndarray:  # [width] bool, True = allowed
        """The ids the grammar allows next. ``width``: the logits' width (default: the tokenizer's vocab_size)."""
        return self._bool(self._fill(), width or self.vocab_size)

    def block_masks(self, draft_token_ids, width: int | None = None) -> np.ndarray:
        """One mask per scored position of a block: [len(draft_token_ids) + 1, width] bool.

        Row i is the mask after the first i draft ids (row 0: the current state; the last row: the bonus
        position). Rows after the first draft id the grammar forbids are all True: the rejection rule never gets
        past that id (its target probability is 0), and an all-forbidden row would make the row's softmax NaN.
        The matcher is left as it was (advanced and rolled back), as in vLLM's spec decode.
        """
        width = width or self.vocab_size
        ids = [int(t) for t in draft_token_ids]
        out = np.ones((len(ids) + 1, width), dtype=bool)
        consumed = 0
        try:
            for i in range(len(ids) + 1):
                out[i] = self.mask(width)
                if i == len(ids) or ids[i] >= width or not out[i][ids[i]]:
                    break
                if self._consume([ids[i]]) != 1:
                    raise ValueError(f"grammar engine error: {self._m.get_error()}")
                consumed += 1
        finally:
            self.rollback(consumed)
        return out

    def single_allowed(self) -> int | None:
        """The one id the grammar allows next, or None when it allows several (or none)."""
        w = self._fill()
        nonzero = np.flatnonzero(w)
        if nonzero.size != 1:
            return None
        word = int(w[nonzero[0]]) & 0xFFFFFFFF
        if word & (word - 1):  # more than one bit set
            return None
        return int(nonzero[0]) * 32 + word.bit_length() - 1

    def forced_tokens(self, max_tokens: int) -> list[int]:
        """The ids the grammar forces from the current state: while the mask leaves exactly one id, that id (up to
        ``max_tokens``). Their target probability after the mask is 1, so a draft of them is accepted for certain.
        State unchanged."""
        forced: list[int] = []
        try:
            while len(forced) < max_tokens:
                t = self.single_allowed()
                if t is None or self._consume([t]) != 1:
                    break
                forced.append(t)
                if self.is_finished:
                    break
        finally:
            self.rollback(len(forced))
        return forced
