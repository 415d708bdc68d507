"""In-process session store (one replica, tests, ``specdec generate`` without a server).

Same semantics as :class:`~cloud_verifier.store.redis.RedisSessionStore`, TTL included: a session expires
``ttl_s`` seconds after its last activity (checked lazily against ``time.monotonic()``).
"""

from __future__ import annotations

import threading
import time

from specdec_runtime.cloud_verifier.store.base import (
    SessionRecord,
    SessionStore,
    check_tokens,
    copy_record,
    extend_conflict,
    finished_error,
    generating_error,
    length_mismatch,
    not_found,
    not_owner,
)


def _already_applied(record: SessionRecord, expected_length: int, token_ids, seq: int) -> bool:
    """The commit of block ``seq`` (``token_ids`` after ``expected_length``) is the last one the record holds:
    a retry of a commit whose answer was lost."""
    n = len(token_ids)
    return (record.last_seq == int(seq) and record.committed_length == expected_length + n
            and record.committed_token_ids[expected_length:] == [int(t) for t in token_ids])


class MemorySessionStore(SessionStore):
    """In-process store with the same semantics as Redis, TTL included (lazy expiry by monotonic time)."""

    def __init__(self, ttl_s: float = 600):
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._records: dict[str, SessionRecord] = {}
        self._deadlines: dict[str, float] = {}  # session id -> time.monotonic() deadline, s

    def _live(self, session_id: str) -> SessionRecord | None:
        """The stored record if not expired (expired ones are dropped). Caller holds the lock."""
        record = self._records.get(session_id)
        if record is None:
            return None
        if time.monotonic() >= self._deadlines[session_id]:
            del self._records[session_id], self._deadlines[session_id]
            return None
        return record

    def _refresh(self, session_id: str) -> None:
        self._deadlines[session_id] = time.monotonic() + self.ttl_s

    def create(self, record: SessionRecord) -> None:
        check_tokens(record.committed_token_ids)
        with self._lock:
            if self._live(record.session_id) is not None:
                raise ValueError(f"session {record.session_id!r} exists")
            self._records[record.session_id] = copy_record(record)
            self._refresh(record.session_id)

    def get(self, session_id: str) -> SessionRecord | None:
        with self._lock:
            record = self._live(session_id)
            return None if record is None else copy_record(record)

    def append_committed(self, session_id, expected_length, token_ids, seq, finished, finish_reason, now,
                         verifier_id=None, logprobs=None) -> int:
        check_tokens(token_ids)
        with self._lock:
            record = self._live(session_id)
            if record is None:
                raise not_found(session_id)
            if verifier_id is not None and record.verifier_id != verifier_id:
                raise not_owner(session_id, verifier_id)
            if record.committed_length != expected_length:
                if _already_applied(record, expected_length, token_ids, seq):
                    record.last_seen_at = now
                    self._refresh(session_id)
                    return record.committed_length
                raise length_mismatch(session_id, expected_length, record.committed_length)
            if record.finished:
                raise finished_error(session_id)
            record.committed_token_ids.extend(int(t) for t in token_ids)
            record.output_logprobs.extend(logprobs or ())
            record.last_seq = int(seq)
            record.finished = bool(finished)
            record.finish_reason = finish_reason if finished else None
            record.last_seen_at = now
            self._refresh(session_id)
            return record.committed_length

    def extend(self, session_id, expected_length, token_ids, sampling, stopping, now, verifier_id) -> int:
        check_tokens(token_ids)
        with self._lock:
            record = self._live(session_id)
            if record is None:
                raise not_found(session_id)
            if record.verifier_id != verifier_id:
                raise not_owner(session_id, verifier_id)
            if record.committed_length != expected_length:
                raise extend_conflict(session_id, expected_length, record.committed_length)
            if not record.finished and record.committed_length != record.prompt_length:
                raise generating_error(session_id)
            record.committed_token_ids.extend(int(t) for t in token_ids)
            record.prompt_length = record.committed_length
            record.sampling, record.stopping, record.seed = sampling, stopping, int(sampling.seed)
            record.finished, record.finish_reason, record.output_logprobs = False, None, []
            record.last_seen_at = now
            self._refresh(session_id)
            return record.committed_length

    def touch(self, session_id: str, now: float) -> bool:
        with self._lock:
            record = self._live(session_id)
            if record is None:
                return False
            record.last_seen_at = now
            self._refresh(session_id)
            return True

    def delete(self, session_id: str, verifier_id: str | None = None) -> bool:
        with self._lock:
            record = self._live(session_id)
            if record is None or (verifier_id is not None and record.verifier_id != verifier_id):
                return False
            del self._records[session_id], self._deadlines[session_id]
            return True

    def claim(self, session_id: str, verifier_id: str, now: float) -> bool:
        with self._lock:
            record = self._live(session_id)
            if record is None:
                return False
            record.verifier_id = verifier_id
            record.last_seen_at = now
            self._refresh(session_id)
            return True

    def disown(self, session_id: str, verifier_id: str) -> bool:
        with self._lock:
            record = self._live(session_id)
            if record is None or record.verifier_id != verifier_id:
                return False
            record.verifier_id = ""
            return True

    def session_ids_of(self, verifier_id: str) -> list[str]:
        with self._lock:
            return [
                sid
                for sid in list(self._records)
                if (r := self._live(sid)) is not None and r.verifier_id == verifier_id
            ]

    def ping(self) -> bool:
        return True
