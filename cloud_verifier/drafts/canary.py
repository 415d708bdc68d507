"""Canary decisions: a draft version handed to a fraction of clients (``specdec draft publish --canary F``,
:func:`cloud_verifier.drafts.catalog.start_canary`) is promoted or rolled back from what it measured.

:meth:`CanaryJudge.check` compares, for each running canary, its shared acceptance record with the current
version's (:mod:`cloud_verifier.drafts.ledger`: every replica's counts), once both have at least ``min_blocks``
verify steps: promoted (made ``CURRENT``) when its acceptance rate and its mean accepted length (tokens per
verify step) are both no worse than the current version's, within ``margin``; rolled back otherwise (never
handed out again; its clients take the current version at their next generation). A decision is logged and
counted (``specdec_draft_canary_decisions_total{draft_version, decision}``). So a bad version is rolled back
within ``min_blocks`` of its own verify steps once the current version has as many, plus the flush interval.

The verifier runs the check from ResolveDraft (at most once per ``check_interval_s``): the clients that ask
which draft to use are what moves a canary, and the files it writes are the catalog's own. Several replicas
reading one shared drafts folder reach the same decision from the same shared record; the first writes it.
Outputs never depend on any of this: every draft version is verified by the same target (lossless).

Which clients get a canary: :class:`CanaryAssignment`, fair (the n-th new client by the canary's shared counter)
and sticky per client id.
"""

from __future__ import annotations

import logging
import threading

from prometheus_client import Counter

from specdec_runtime.cloud_verifier.drafts.catalog import DraftCatalog, end_canary, in_canary
from specdec_runtime.cloud_verifier.drafts.periodic import PeriodicCheck
from specdec_runtime.cloud_verifier.drafts.ledger import AcceptanceLedger, DraftAcceptance

log = logging.getLogger(__name__)

CANARY_DECISIONS = Counter("specdec_draft_canary_decisions", "Canary draft versions promoted or rolled back",
                           ["draft_version", "decision"])


ASSIGNMENT_TTL_S = 30 * 24 * 3600  # a canary's client answers live this long after its last new client, s

# KEYS[1] the canary's hash (client id -> 0/1, "#n" -> clients so far); ARGV: client id, fraction, ttl s
_ASSIGN_LUA = """
local got = redis.call('HGET', KEYS[1], ARGV[1])
if got then return tonumber(got) end
local n = redis.call('HINCRBY', KEYS[1], '#n', 1) - 1
local f = tonumber(ARGV[2])
local yes = 0
if math.floor((n + 1) * f + 1e-9) > math.floor(n * f + 1e-9) then yes = 1 end
redis.call('HSET', KEYS[1], ARGV[1], yes)
redis.call('EXPIRE', KEYS[1], ARGV[3])
return yes
"""


def stride_pick(n: int, fraction: float) -> bool:
    """Whether the ``n``-th client (from 0) of a canary at ``fraction`` gets it: floor((n+1)·f) > floor(n·f),
    so the first ``k`` clients hold floor(k·f) of it, whatever their ids (a hash would give a binomial count)."""
    return int((n + 1) * fraction + 1e-9) > int(n * fraction + 1e-9)


class CanaryAssignment:
    """Which clients get a running canary (the catalog's ``assign_canary``): each new client id gets the next
    number of the canary's counter and the canary when :func:`stride_pick` says so; its answer is kept (sticky for
    the canary's whole run). With ``redis`` (the session store's) the counter and the answers are one hash per
    canary version, ``<prefix>draft:{name@version}:canary``, updated in one Lua script: every replica hands out
    the same split. Without: kept in this process. A client without an id is drawn at random
    (:func:`~cloud_verifier.drafts.catalog.in_canary`)."""

    def __init__(self, redis=None, prefix: str = ""):
        self._redis, self._prefix = redis, prefix
        self._script = redis.register_script(_ASSIGN_LUA) if redis is not None else None
        self._lock = threading.Lock()
        self._local: dict[str, dict[str, bool]] = {}

    def __call__(self, client_id: str, name: str, version: str, fraction: float) -> bool:
        if not client_id:
            return in_canary(client_id, name, version, fraction)
        label = f"{name}@{version}"
        if self._script is not None:
            key = f"{self._prefix}draft:{{{label}}}:canary"
            return bool(self._script(keys=[key], args=[client_id, repr(float(fraction)), ASSIGNMENT_TTL_S]))
        with self._lock:
            answers = self._local.setdefault(label, {})
            if client_id not in answers:
                answers[client_id] = stride_pick(len(answers), fraction)
            return answers[client_id]


def _tau(r: DraftAcceptance) -> float:
    """Mean accepted length: tokens per verify step (1 + accepted / steps)."""
    return 1.0 + r.num_accepted_tokens / r.num_drafts if r.num_drafts else 1.0


def no_worse(canary: DraftAcceptance, current: DraftAcceptance, margin: float) -> bool:
    """The canary's acceptance rate is at least the current version's minus ``margin``, and its mean accepted
    length at least the current one's times (1 - ``margin``)."""
    rate_c, rate_0 = canary.acceptance_rate or 0.0, current.acceptance_rate or 0.0
    return rate_c >= rate_0 - margin and _tau(canary) >= _tau(current) * (1.0 - margin)


class CanaryJudge(PeriodicCheck):
    """Promotes or rolls back the canaries of ``catalog`` from ``ledger``'s shared records (module docstring).

    Args:
        min_blocks: verify steps each of the canary and the current version needs before a decision, blocks.
        margin: how much worse the canary may measure and still be promoted (acceptance rate, absolute;
            mean accepted length, relative).
        check_interval_s: :meth:`maybe_check` runs :meth:`check` at most this often, s.
    """

    what = "canary check"

    def __init__(self, catalog: DraftCatalog, ledger: AcceptanceLedger, *, min_blocks: int = 200,
                 margin: float = 0.05, check_interval_s: float = 5.0):
        super().__init__(check_interval_s)
        self.catalog = catalog
        self.ledger = ledger
        self.min_blocks = min_blocks
        self.margin = margin

    def check(self) -> list[tuple[str, str]]:
        """Decide every canary that has enough blocks; returns ``(name@version, "promote" | "rollback")`` of the
        decisions taken now."""
        self.ledger.flush()  # this replica's counts first: the record is every replica's
        decisions = []
        for name, (version, _fraction) in self.catalog.canaries().items():
            current = self.catalog.current(name)
            if current is None or current == version:
                continue
            trial = self.ledger.record(f"{name}@{version}")
            base = self.ledger.record(f"{name}@{current}")
            if trial.num_drafts < self.min_blocks or base.num_drafts < self.min_blocks:
                continue
            promote = no_worse(trial, base, self.margin)
            if end_canary(self.catalog.root, name, promote) is None:
                continue  # another replica decided first
            decision = "promote" if promote else "rollback"
            CANARY_DECISIONS.labels(f"{name}@{version}", decision).inc()
            log.warning("draft canary %s@%s %s: acceptance %.3f vs %.3f (%s@%s), mean accepted length %.2f vs %.2f, "
                        "over %d and %d verify steps", name, version, "promoted" if promote else "rolled back",
                        trial.acceptance_rate or 0.0, base.acceptance_rate or 0.0, name, current, _tau(trial),
                        _tau(base), trial.num_drafts, base.num_drafts)
            decisions.append((f"{name}@{version}", decision))
        if decisions:
            self.catalog.rescan()
        return decisions
