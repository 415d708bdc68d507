"""The acceptance watchdog: a draft version whose acceptance falls below its baseline is quarantined.

The commonest silent failure of speculation is a draft that no longer fits its target (a target upgrade, a broken
conversion, drifted traffic): acceptance collapses and everything gets slower than no speculation at all. For each
version handed out (``CURRENT`` and a running canary), :meth:`Watchdog.check` compares this replica's windowed
acceptance (its last ``window_blocks`` verify steps, :meth:`~cloud_verifier.drafts.ledger.AcceptanceLedger.window`)
with the version's baseline (its first verify steps over all replicas, frozen in the shared record). Below the
baseline by more than ``margin`` (absolute acceptance rate), with a full window: the version is **quarantined**
(``<name>/QUARANTINED``, :func:`~cloud_verifier.drafts.catalog.set_quarantine`). New clients then get the
previous good version, or, when there is none, the quarantined one with its reason, and the SDK runs their new
generations on the cloud route. Sessions already open go on as they are: every block is verified by the target,
so nothing wrong reaches an output, only speed is at stake. Logged (one WARNING line with both rates), counted
(``specdec_draft_quarantines_total``) and shown (``specdec_draft_quarantined{draft_version}`` = 1).

Back to normal: ``specdec draft clear NAME VERSION`` (the operator), or automatically when the window of a
quarantined version that still drafts here (sessions opened before) is back within ``margin / 2`` of the
baseline. The check runs from ResolveDraft, at most once per ``check_interval_s``, with the canary judge.
"""

from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge

from specdec_runtime.cloud_verifier.drafts.catalog import DraftCatalog, set_quarantine
from specdec_runtime.cloud_verifier.drafts.periodic import PeriodicCheck
from specdec_runtime.cloud_verifier.drafts.ledger import AcceptanceLedger

log = logging.getLogger(__name__)

QUARANTINES = Counter("specdec_draft_quarantines", "Draft versions quarantined by the acceptance watchdog",
                      ["draft_version"])
QUARANTINED = Gauge("specdec_draft_quarantined", "1 while a draft version is quarantined (this replica's view)",
                    ["draft_version"])


class Watchdog(PeriodicCheck):
    """Quarantines the versions of ``catalog`` whose windowed acceptance falls below their baseline (module
    docstring). ``margin``: acceptance-rate points below the baseline that trip it; ``check_interval_s``:
    :meth:`maybe_check`'s period, s. The window length is the ledger's ``window_blocks``."""

    what = "draft watchdog check"

    def __init__(self, catalog: DraftCatalog, ledger: AcceptanceLedger, *, margin: float = 0.2,
                 check_interval_s: float = 5.0):
        super().__init__(check_interval_s)
        self.catalog = catalog
        self.ledger = ledger
        self.margin = margin

    def check(self) -> list[tuple[str, str]]:
        """Quarantine or release every version due; returns ``(name@version, "quarantine" | "recovered")``."""
        changes = []
        for manifest in self.catalog.list_all():
            name, version, label = manifest.name, manifest.version, manifest.label
            bad = self.catalog.quarantined(name)
            if version not in bad and version != self.catalog.current(name) and version not in {
                    v for v, _ in self.catalog.canaries().values()}:
                continue  # not handed out: nothing drafts with it
            steps, drafted, accepted = self.ledger.window(label)
            if steps < self.ledger.window_blocks or not drafted:
                continue
            baseline = self.ledger.record(label).baseline_acceptance_rate
            if baseline is None:
                continue
            rate = accepted / drafted
            if version not in bad and rate < baseline - self.margin:
                why = (f"acceptance {rate:.3f} over its last {steps} verify steps, baseline {baseline:.3f} "
                       f"(margin {self.margin:g})")
                set_quarantine(self.catalog.root, name, version, why)
                QUARANTINES.labels(label).inc()
                QUARANTINED.labels(label).set(1)
                log.warning("draft %s quarantined: %s; new clients get the previous good version or the cloud "
                            "route", label, why)
                changes.append((label, "quarantine"))
            elif version in bad and rate >= baseline - self.margin / 2:
                set_quarantine(self.catalog.root, name, version, None)
                QUARANTINED.labels(label).set(0)
                log.warning("draft %s out of quarantine: acceptance %.3f over its last %d verify steps, baseline "
                            "%.3f", label, rate, steps, baseline)
                changes.append((label, "recovered"))
        if changes:
            self.catalog.rescan()
        return changes
