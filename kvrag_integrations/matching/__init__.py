"""Find, inside a prompt, the runs of token ids that stored KV-cache entries hold.

``ContentIndex`` indexes token-id sequences per namespace and covers a prompt
with maximal runs it shares with them (any offset, any order); ``SyncedIndex``
keeps one in step with an append-only ``IndexLog`` on the store (disk, Redis
or memory), so the index survives a restart and replicas share it. No torch,
no vLLM: numpy only.
"""

from kvrag_integrations.matching.index import ContentIndex
from kvrag_integrations.matching.log import (
    DiskIndexLog,
    IndexLog,
    MemoryIndexLog,
    RedisIndexLog,
    SyncedIndex,
    index_log_for,
    open_index_log,
)
from kvrag_integrations.matching.runs import Run

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
