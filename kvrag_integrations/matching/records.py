"""The index log's binary record: ``(namespace, ids)``, self-delimiting and checksummed.

Layout (little-endian): a 16-byte header, then the namespace (UTF-8) and the
ids (int32)::

    magic b"KVIX" | version u8 | flags u8 (0) | namespace bytes u16 | ids u32 | crc32 u32

The CRC-32 covers the header's bytes 4..12 and the body, so a damaged length
is caught too. A reader that meets a record it cannot parse looks for the next
whole valid record: if there is one, the bad bytes are skipped; if not, they
are the tail, perhaps still being written, and are read again later.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

MAGIC = b"KVIX"
VERSION = 1
HEADER = struct.Struct("<4sBBHII")
MAX_NAMESPACE_BYTES = 4096
MAX_RECORD_IDS = 1 << 17  # 131,072 ids: far beyond a whole 4k-token prompt


class RecordError(ValueError):
    """A record that cannot be written (empty, too long, ids outside int32)."""


def encode_record(namespace: str, ids: object) -> bytes:
    """The bytes of one record.

    Examples:
        >>> data = encode_record("m", [1, 2, 3])
        >>> len(data), parse_records(data)[0][0][0], parse_records(data)[0][0][1].tolist()
        (29, 'm', [1, 2, 3])
    """
    if not isinstance(namespace, str):
        raise RecordError(f"namespace must be a str, got {type(namespace).__name__}")
    name = namespace.encode("utf-8")
    arr = np.asarray(ids)
    if arr.ndim != 1 or not 0 < len(arr) <= MAX_RECORD_IDS or arr.dtype.kind not in "iu":
        raise RecordError(f"ids must be 1 to {MAX_RECORD_IDS} integers")
    if arr.min() < 0 or arr.max() > np.iinfo(np.int32).max:
        raise RecordError("ids must fit in int32 and be >= 0")
    if len(name) > MAX_NAMESPACE_BYTES:
        raise RecordError(f"namespace is over {MAX_NAMESPACE_BYTES} bytes")
    body = name + arr.astype("<i4").tobytes()
    fields = struct.pack("<BBHI", VERSION, 0, len(name), len(arr))
    crc = zlib.crc32(body, zlib.crc32(fields))
    return MAGIC + fields + struct.pack("<I", crc) + body


def _parse_one(buf: bytes, at: int) -> tuple[str, np.ndarray, int] | None:
    """``(namespace, ids, end)`` of a whole valid record at ``at``, else None."""
    if len(buf) - at < HEADER.size:
        return None
    magic, version, flags, name_len, count, crc = HEADER.unpack_from(buf, at)
    if magic != MAGIC or version != VERSION or flags or not 0 < count <= MAX_RECORD_IDS:
        return None
    if name_len > MAX_NAMESPACE_BYTES:
        return None
    body = at + HEADER.size
    end = body + name_len + 4 * count
    if end > len(buf):
        return None
    view = memoryview(buf)
    if zlib.crc32(view[body:end], zlib.crc32(view[at + 4 : at + 12])) != crc:
        return None
    try:
        namespace = bytes(view[body : body + name_len]).decode("utf-8")
    except UnicodeDecodeError:
        return None
    ids = np.frombuffer(buf, "<i4", count, body + name_len).astype(np.int32)
    if ids.min() < 0:
        return None
    return namespace, ids, end


def parse_records(buf: bytes) -> tuple[list[tuple[str, np.ndarray]], int, int]:
    """``(records, consumed, skipped)``: the whole valid records in ``buf``, how many
    bytes were consumed (what follows is an incomplete or unproven tail, to read
    again with more bytes) and how many of those were skipped as damaged."""
    records: list[tuple[str, np.ndarray]] = []
    at = skipped = 0
    while at < len(buf):
        parsed = _parse_one(buf, at)
        if parsed is not None:
            records.append(parsed[:2])
            at = parsed[2]
            continue
        resume = _next_valid(buf, at + 1)
        if resume is None:  # a torn (or damaged) tail: wait for what follows it
            break
        skipped += resume - at
        at = resume
    return records, at, skipped


def _next_valid(buf: bytes, start: int) -> int | None:
    """Where the next whole valid record after ``start`` begins, if any."""
    at = buf.find(MAGIC, start)
    while at >= 0:
        if _parse_one(buf, at) is not None:
            return at
        at = buf.find(MAGIC, at + 1)
    return None
