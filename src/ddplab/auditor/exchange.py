"""How ranks' records meet without a collective: each rank publishes once to the store; rank 0 never waits.

Rank 0 reads its peers' records only once a non-blocking ``store.check`` shows they are all there,
and then prints the merged report (the one place the auditor writes to the program's stderr).
"""

from __future__ import annotations

import datetime
import json
import sys

from ddplab.auditor import findings as fnd
from ddplab.auditor import rendering
from ddplab.auditor.state import AuditState
from ddplab.runtime import compat

STORE_PREFIX = "ddplab-audit/v2/"
# Sync forwards rank 0 keeps looking for its peers' records after its own window closed.
REPORT_PATIENCE = 1000


def _keys(audit: AuditState, ranks) -> list[str]:
    return [f"{STORE_PREFIX}{rank}" for rank in ranks]


def publish(audit: AuditState) -> None:
    """This rank's record into the store, once, for rank 0 to read without waiting."""
    if audit.published or audit.world_size == 1:
        return
    audit.published = True
    store = compat.default_store()
    if store is not None:
        store.set(f"{STORE_PREFIX}{audit.rank}", json.dumps(audit.record()))


def poll_peers(audit: AuditState) -> None:
    """Rank 0 prints the report once every peer's record is in the store; it never waits for one."""
    if audit.rank != 0 or audit.reported or audit.report_polls >= REPORT_PATIENCE or audit.world_size == 1:
        return
    audit.report_polls += 1
    store = compat.default_store()
    keys = _keys(audit, range(1, audit.world_size))
    if store is None or not store.check(keys):
        return
    audit.reported = True
    audit.peers = [json.loads(store.get(key)) for key in keys]
    report = fnd.merge([audit.record(), *audit.peers])
    audit.interim = report.signature()
    audit.write()
    print(rendering.render_text(report, interim_steps=audit.steps), file=sys.stderr, flush=True)


def gather(audit: AuditState, timeout: float) -> fnd.Report:
    """Every rank's record, waiting up to ``timeout`` seconds for the peers' (from the user's own code)."""
    publish(audit)
    store = compat.default_store()
    records = [audit.record()]
    if store is not None and audit.world_size > 1:
        keys = _keys(audit, (rank for rank in range(audit.world_size) if rank != audit.rank))
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout))
            records += [json.loads(store.get(key)) for key in keys]
        except Exception as exc:  # noqa: BLE001 - a peer that never published: report what is here
            records[0]["findings"].append(vars(fnd.Finding.make(
                "AUDIT_INCOMPLETE", audit.rank, f"not every rank's record arrived within {timeout:g} s ({exc})")))
    return fnd.merge(records)
