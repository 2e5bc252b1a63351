"""Find, inside a prompt, the runs of token ids that stored KV-cache entries hold.

``ContentIndex`` indexes token-id sequences per namespace and covers a prompt
with maximal runs it shares with them (any offset, any order); ``SyncedIndex``
keeps one in step with an ``IndexLog`` on the store (disk, Redis or memory:
appended to, and compacted to the live entries by the store's budget), so the
index survives a restart and replicas share it. No torch, no vLLM: numpy only.
"""

from kvrag_integrations.matching.index import ContentIndex
from kvrag_integrations.matching.log import IndexLog, MemoryIndexLog
from kvrag_integrations.matching.runs import Run
from kvrag_integrations.matching.store_logs import (
    DiskIndexLog,
    RedisIndexLog,
    index_log_for,
    open_index_log,
)
from kvrag_integrations.matching.synced import SyncedIndex

__all__ = [
    "ContentIndex",
    "DiskIndexLog",
    "IndexLog",
    "MemoryIndexLog",
    "RedisIndexLog",
    "Run",
    "SyncedIndex",
    "index_log_for",
    "open_index_log",
]
