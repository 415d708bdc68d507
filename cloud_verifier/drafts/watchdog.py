"""The acceptance watchdog: a draft version whose acceptance falls below its baseline is quarantined.

The commonest silent failure of speculation is a draft that no longer fits its target (a target upgrade, a broken
conversion, drifted traffic): acceptance collapses and everything gets slower than no speculation at all. For each
version handed out (``CURRENT`` and a running canary) and each tenant that drafts with it, :meth:`Watchdog.check`
compares the tenant's windowed acceptance (its last ``window_blocks`` verify steps over every replica,
:mod:`cloud_verifier.drafts.window`) with the version's baseline (its first verify steps over all replicas, frozen
in the shared record; or the acceptance rate its publish-time benchmark measured, ``draft publish --baseline-from``).
Below the baseline by more than ``margin`` (absolute acceptance rate), with a full window:
the version is **quarantined for that tenant** (``<name>/QUARANTINED``,
:func:`~cloud_verifier.drafts.catalog.set_quarantine`; a version that fails one tenant's traffic keeps serving the
others). That tenant's new clients then get the previous good version, or, when there is none, the quarantined
one with its reason, and the SDK runs their new generations on the cloud route. Sessions already open go on as they are: every block is verified by the target,
so nothing wrong reaches an output, only speed is at stake. Logged (one WARNING line with both rates), counted
(``specdec_draft_quarantines_total{draft_version, tenant}``, by the replica that wrote it) and shown on every
replica (``specdec_draft_quarantined{draft_version}``: the tenants it is quarantined for, 0 = none).

A quarantine starts the tenant's window afresh: it then holds the steps of the sessions that still draft with the
version (opened before). Back to normal: ``specdec draft clear NAME VERSION`` (the operator), or automatically when
that fresh window is full and back within ``margin / 2`` of the baseline. The check runs in the background on every
replica (:meth:`cloud_verifier.drafts.delivery.DraftDelivery.run_checks`), at most once per ``check_interval_s``,
with the canary judge, and from ResolveDraft; every replica reads the same windows, records and folder, so they
reach the same decisions.
"""

from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge

from specdec_runtime.cloud_verifier.drafts.catalog import ALL_TENANTS, DraftCatalog, set_quarantine
from specdec_runtime.cloud_verifier.drafts.periodic import PeriodicCheck
from specdec_runtime.cloud_verifier.drafts.ledger import AcceptanceLedger

log = logging.getLogger(__name__)

QUARANTINES = Counter("specdec_draft_quarantines", "Draft versions quarantined by the acceptance watchdog",
                      ["draft_version", "tenant"])
QUARANTINED = Gauge("specdec_draft_quarantined", "Tenants a draft version is quarantined for (0 = none)",
                    ["draft_version"])


class Watchdog(PeriodicCheck):
    """Quarantines, per tenant, the versions of ``catalog`` whose windowed acceptance falls below their baseline
    (module docstring). ``margin``: acceptance-rate points below the baseline that trip it; ``check_interval_s``:
    :meth:`maybe_check`'s period, s. The window length is the ledger's ``window_blocks``."""

    what = "draft watchdog check"

    def __init__(self, catalog: DraftCatalog, ledger: AcceptanceLedger, *, margin: float = 0.2,
                 check_interval_s: float = 5.0):
        super().__init__(check_interval_s)
        self.catalog = catalog
        self.ledger = ledger
        self.margin = margin

    def check(self) -> list[tuple[str, str]]:
        """Quarantine or release every (version, tenant) due; returns ``(name@version, "quarantine:TENANT" |
        "recovered:TENANT")`` of the decisions this replica wrote."""
        self.ledger.flush()  # this replica's steps first: the windows are every replica's
        changes = []
        canaries = {v for v, _ in self.catalog.canaries().values()}
        for manifest in self.catalog.list_all():
            name, version, label = manifest.name, manifest.version, manifest.label
            states = self.catalog.quarantine_states(name).get(version, {})
            if not states and version != self.catalog.current(name) and version not in canaries:
                continue  # not handed out: nothing drafts with it
            baseline = manifest.baseline_acceptance_rate  # the publish-time benchmark's, else the first steps'
            if baseline is None:
                baseline = self.ledger.record(label).baseline_acceptance_rate
            if baseline is None:
                continue
            for tenant in sorted(self.ledger.windows.tenants(label)):
                change = self._judge(name, version, tenant, baseline, states)
                if change:
                    changes.append((label, f"{change}:{tenant}"))
        if changes:
            self.catalog.rescan()
        self.show()
        return changes

    def _judge(self, name: str, version: str, tenant: str, baseline: float, states: dict[str, str]) -> str | None:
        """Quarantine or release ``version`` for ``tenant`` from its window; the decision written, or None."""
        label = f"{name}@{version}"
        steps, drafted, accepted = self.ledger.windows.window(label, tenant)
        if steps < self.ledger.window_blocks or not drafted:
            return None
        rate = accepted / drafted
        if tenant not in states and ALL_TENANTS not in states and rate < baseline - self.margin:
            why = (f"acceptance {rate:.3f} over its last {steps} verify steps, baseline {baseline:.3f} "
                   f"(margin {self.margin:g})")
            self.ledger.windows.reset(label, tenant)  # from now on: the sessions still drafting with it
            if not set_quarantine(self.catalog.root, name, version, why, tenant):
                return None  # another replica wrote it first
            QUARANTINES.labels(label, tenant).inc()
            log.warning("draft %s quarantined: %s, tenant %s; its new clients get the previous good version or the "
                        "cloud route", label, why, tenant or "-")
            return "quarantine"
        if tenant in states and rate >= baseline - self.margin / 2:
            if not set_quarantine(self.catalog.root, name, version, None, tenant):
                return None
            log.warning("draft %s out of quarantine: acceptance %.3f over its last %d verify steps, baseline %.3f, "
                        "tenant %s", label, rate, steps, baseline, tenant or "-")
            return "recovered"
        return None

    def show(self) -> None:
        """Set ``specdec_draft_quarantined`` of every version from the shared folder (every replica the same)."""
        for manifest in self.catalog.list_all():
            states = self.catalog.quarantine_states(manifest.name).get(manifest.version, {})
            QUARANTINED.labels(manifest.label).set(len(states))
