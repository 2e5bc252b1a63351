"""Byte format of one stored ``ChunkKV``: safetensors plus an integrity code, never pickle.

An entry is a safetensors blob with three tensors (``token_ids``, ``keys``,
``values``) and string metadata: ``format`` (:data:`FORMAT_VERSION`),
``fingerprint``, ``key`` (the entry's ``cache_key``), ``integrity`` (the code's
algorithm) and ``checksum``. The code covers everything the decoder trusts:
the format, fingerprint and key, each tensor's name, dtype and shape as the
header states them, and the payload bytes. So a header edit that keeps the
bytes (a dtype or shape rewritten) fails it, not only a flipped payload byte.

The code is xxh3-128 (fast: ~20 GB/s, against accidents) or, when the store
has a secret, HMAC-SHA256 keyed with it (against anyone who can write to the
store but does not hold the secret). An entry made one way is refused by a
store configured the other way.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct

import safetensors.torch
import torch
import xxhash

from kvrag_integrations.engine.kv import ChunkKV, cache_key
from kvrag_integrations.errors import CacheEntryError

FORMAT_VERSION = "kvrag-chunk-v2"

# The environment variable a store reads its secret from when none is given.
SECRET_ENV = "KVRAG_STORE_SECRET"

_TENSOR_NAMES = ("token_ids", "keys", "values")
_METADATA_NAMES = ("format", "fingerprint", "key", "checksum")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def store_secret(secret: str | bytes | None = None) -> bytes | None:
    """The secret a store signs entries with: ``secret``, else ``$KVRAG_STORE_SECRET``,
    else None."""
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
    if secret is None:
        return None
    key = secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)
    if not key:
        raise ValueError("a store secret must not be empty")
    return key


def _payload(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, in memory order, without a copy."""
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: same bits as int16
        tensor = tensor.view(torch.int16)
    return memoryview(tensor.numpy()).cast("B")


def _checksum(
    metadata: dict[str, str], tensors: dict[str, torch.Tensor], secret: bytes | None
) -> tuple[str, str]:
    """``(integrity, code)`` over the metadata the decoder trusts, each tensor's
    dtype and shape, and the payload."""
    described = {
        "format": metadata["format"],
        "fingerprint": metadata["fingerprint"],
        "key": metadata["key"],
        "tensors": [[n, str(tensors[n].dtype), list(tensors[n].shape)] for n in _TENSOR_NAMES],
    }
    head = json.dumps(described, sort_keys=True).encode("utf-8")
    if secret is None:
        digest, integrity = xxhash.xxh3_128(), "xxh3-128"
    else:
        digest, integrity = hmac.new(secret, digestmod=hashlib.sha256), "hmac-sha256"
    digest.update(struct.pack("<Q", len(head)) + head)
    for name in _TENSOR_NAMES:
        digest.update(_payload(tensors[name]))
    return integrity, digest.hexdigest()


def encode_entry(kv: ChunkKV, secret: bytes | None = None) -> bytes:
    """Serialize ``kv`` to self-verifying safetensors bytes.

    Args:
        kv: the entry; K/V keep their dtype (float32, float16 or bfloat16).
        secret: sign with HMAC-SHA256 under this key (see :func:`store_secret`);
            None: an xxh3-128 checksum.

    Returns:
        The bytes that :func:`decode_entry` turns back into an equal ``ChunkKV``.
    """
    tensors = {
        "token_ids": kv.token_ids.detach().to(device="cpu", dtype=torch.int64).contiguous(),
        "keys": kv.keys.detach().cpu().contiguous(),
        "values": kv.values.detach().cpu().contiguous(),
    }
    metadata = {"format": FORMAT_VERSION, "fingerprint": kv.fingerprint, "key": kv.key}
    metadata["integrity"], metadata["checksum"] = _checksum(metadata, tensors, secret)
    return safetensors.torch.save(tensors, metadata=metadata)


def header_length(first8: bytes) -> int:
    """Length of the JSON header that follows the first 8 bytes of an entry.

    Args:
        first8: the entry's first 8 bytes (a little-endian u64).

    Raises:
        CacheEntryError: fewer than 8 bytes.
    """
    if len(first8) < 8:
        raise CacheEntryError(f"entry is {len(first8)} bytes, too short for a safetensors header")
    (header_len,) = struct.unpack("<Q", first8[:8])
    return int(header_len)


def _header(data: bytes) -> dict:
    """The JSON header of an entry from (at least) its first ``8 + header_length`` bytes.

    safetensors.torch.load drops the metadata, so the header is read directly:
    8 bytes little-endian header length, then the header itself.
    """
    header_len = header_length(data)
    if header_len > len(data) - 8:
        raise CacheEntryError("entry is truncated: header runs past the end of the data")
    try:
        header = json.loads(data[8 : 8 + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CacheEntryError(f"entry header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise CacheEntryError("entry header is not a JSON object")
    return header


def entry_size(head: bytes) -> int:
    """Total size of an entry from its first ``8 + header_length`` bytes: the size
    the header itself declares (stores read no more than this).

    Raises:
        CacheEntryError: the header is truncated, not JSON or has bad offsets.
    """
    header = _header(head)
    try:
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise CacheEntryError(f"entry header has bad offsets: {exc}") from exc
    return 8 + header_length(head) + max(ends, default=0)


def read_metadata(data: bytes) -> dict[str, str]:
    """The entry's metadata (``format``, ``fingerprint``, ``key``, ``checksum``, and
    from format v2 ``integrity``), unverified.

    Only the header is parsed, so ``data`` may be just the entry's first
    ``8 + header_length(data[:8])`` bytes: stores use it to describe an entry
    without reading its tensors.

    Raises:
        CacheEntryError: the header is truncated, not JSON or lacks a field.
    """
    header = _header(data)
    metadata = header.get("__metadata__")
    if not isinstance(metadata, dict):
        raise CacheEntryError("entry has no metadata")
    missing = [name for name in _METADATA_NAMES if not isinstance(metadata.get(name), str)]
    if missing:
        raise CacheEntryError(f"entry metadata lacks {', '.join(missing)}")
    return metadata


def decode_entry(data: bytes, secret: bytes | None = None) -> ChunkKV:
    """Parse and verify bytes made by :func:`encode_entry`.

    Args:
        data: the stored bytes.
        secret: the store's secret; entries must then carry a valid HMAC under it,
            and without one they must carry the plain checksum.

    Returns:
        The decoded entry, tensors on CPU.

    Raises:
        CacheEntryError: the bytes are not a safetensors blob, have another format
            version, lack a tensor, have dtypes or shapes the cache never has, fail
            the integrity code (header or payload), are signed differently from
            what the store expects, or are stored under a key that does not match
            their content.
    """
    metadata = read_metadata(data)
    if metadata["format"] != FORMAT_VERSION:
        raise CacheEntryError(
            f"entry format {metadata['format']!r} is not {FORMAT_VERSION!r}; it will be rebuilt"
        )
    expected = "xxh3-128" if secret is None else "hmac-sha256"
    if metadata.get("integrity") != expected:
        raise CacheEntryError(
            f"entry is protected by {metadata.get('integrity')!r}, this store expects {expected!r}"
            " (a store secret set on one side only?)"
        )
    try:
        tensors = safetensors.torch.load(data)
    except Exception as exc:  # SafetensorError and friends: truncated or malformed payload
        raise CacheEntryError(f"entry is not valid safetensors: {exc}") from exc
    if set(tensors) != set(_TENSOR_NAMES):
        raise CacheEntryError(
            f"entry holds tensors {sorted(tensors)}, expected {sorted(_TENSOR_NAMES)}"
        )
    _, code = _checksum(metadata, tensors, secret)
    if not hmac.compare_digest(code, metadata["checksum"]):
        raise CacheEntryError(
            "entry checksum mismatch: the integrity check over its header and tensor bytes failed"
        )
    token_ids, keys, values = (tensors[name] for name in _TENSOR_NAMES)
    if token_ids.dtype != torch.int64:
        raise CacheEntryError(f"entry token_ids are {token_ids.dtype}, expected torch.int64")
    if keys.dtype not in _FLOAT_DTYPES or keys.dtype != values.dtype:
        raise CacheEntryError(f"entry keys/values are {keys.dtype}/{values.dtype}")
    try:
        kv = ChunkKV(
            token_ids=token_ids, keys=keys, values=values, fingerprint=metadata["fingerprint"]
        )
    except ValueError as exc:  # shape checks live in ChunkKV itself
        raise CacheEntryError(f"entry shapes are inconsistent: {exc}") from exc
    if cache_key(kv.fingerprint, token_ids) != metadata["key"]:
        raise CacheEntryError("entry key does not match its fingerprint and token ids")
    return kv
