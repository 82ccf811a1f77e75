"""The way events come in: the logs (SQLite journal, JetStream) and the guards on the way.

Modules: ``journal`` (the embedded advisor's SQLite log), ``jslog`` (a JetStream log
reader; import it from there, it loads nats), ``quotas`` (admission limits), ``origin_store``
(the origins a source was first seen from), ``source_expiry`` (dropping a silent source's
private tiers).
"""

from advisor.ingest.journal import BadPayloadError, JournalError, SqliteJournal
from advisor.ingest.quotas import QuotaGuard, QuotaLimits, QuotaReason
from advisor.ingest.origin_store import SqliteOriginStore
from advisor.ingest.source_expiry import expiry_batch, private_blocks

__all__ = [
    "BadPayloadError",
    "expiry_batch",
    "JournalError",
    "private_blocks",
    "QuotaGuard",
    "QuotaLimits",
    "QuotaReason",
    "SqliteJournal",
    "SqliteOriginStore",
]
