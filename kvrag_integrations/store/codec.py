"""Byte format of one stored ``ChunkKV``: safetensors plus a checksum, never pickle.

An entry is a safetensors blob with three tensors (``token_ids``, ``keys``,
``values``) and string metadata: ``format`` (:data:`FORMAT_VERSION`),
``fingerprint``, ``key`` (the entry's ``cache_key``) and ``checksum`` (sha256 over
the raw tensor bytes). safetensors itself does not detect flipped payload bytes,
hence the checksum.
"""

from __future__ import annotations

import hashlib
import json
import struct

import safetensors.torch
import torch

from kvrag_integrations.engine.kv import ChunkKV, cache_key
from kvrag_integrations.errors import CacheEntryError

FORMAT_VERSION = "kvrag-chunk-v1"

_TENSOR_NAMES = ("token_ids", "keys", "values")
_METADATA_NAMES = ("format", "fingerprint", "key", "checksum")


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    """Return the raw bytes of a CPU tensor, in memory order.

    numpy has no bfloat16, so bfloat16 is reinterpreted as int16 (same bits).
    """
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy().tobytes()


def _checksum(token_ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> str:
    digest = hashlib.sha256()
    for tensor in (token_ids, keys, values):
        digest.update(_tensor_bytes(tensor))
    return digest.hexdigest()


def encode_entry(kv: ChunkKV) -> bytes:
    """Serialize ``kv`` to self-verifying safetensors bytes.

    Args:
        kv: the entry; K/V keep their dtype (float32, float16, bfloat16, ...).

    Returns:
        The bytes that :func:`decode_entry` turns back into an equal ``ChunkKV``.
    """
    tensors = {
        "token_ids": kv.token_ids.detach().to(device="cpu", dtype=torch.int64).contiguous(),
        "keys": kv.keys.detach().cpu().contiguous(),
        "values": kv.values.detach().cpu().contiguous(),
    }
    metadata = {
        "format": FORMAT_VERSION,
        "fingerprint": kv.fingerprint,
        "key": kv.key,
        "checksum": _checksum(tensors["token_ids"], tensors["keys"], tensors["values"]),
    }
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


def read_metadata(data: bytes) -> dict[str, str]:
    """The entry's metadata (``format``, ``fingerprint``, ``key``, ``checksum``), unverified.

    Only the header is parsed, so ``data`` may be just the entry's first
    ``8 + header_length(data[:8])`` bytes: stores use it to describe an entry
    without reading its tensors.

    Raises:
        CacheEntryError: the header is truncated, not JSON or lacks a field.
    """
    # safetensors.torch.load drops the metadata, so read the JSON header directly:
    # 8 bytes little-endian header length, then the header itself.
    header_len = header_length(data)
    if header_len > len(data) - 8:
        raise CacheEntryError("entry is truncated: header runs past the end of the data")
    try:
        header = json.loads(data[8 : 8 + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CacheEntryError(f"entry header is not valid JSON: {exc}") from exc
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict):
        raise CacheEntryError("entry has no metadata")
    missing = [name for name in _METADATA_NAMES if not isinstance(metadata.get(name), str)]
    if missing:
        raise CacheEntryError(f"entry metadata lacks {', '.join(missing)}")
    return metadata


def decode_entry(data: bytes) -> ChunkKV:
    """Parse and verify bytes made by :func:`encode_entry`.

    Args:
        data: the stored bytes.

    Returns:
        The decoded entry, tensors on CPU.

    Raises:
        CacheEntryError: the bytes are not a safetensors blob, have another format
            version, lack a tensor, have inconsistent shapes, fail the checksum,
            or are stored under a key that does not match their content.
    """
    metadata = read_metadata(data)
    if metadata["format"] != FORMAT_VERSION:
        raise CacheEntryError(
            f"entry format {metadata['format']!r} is not {FORMAT_VERSION!r}; it will be rebuilt"
        )
    try:
        tensors = safetensors.torch.load(data)
    except Exception as exc:  # SafetensorError and friends: truncated or malformed payload
        raise CacheEntryError(f"entry is not valid safetensors: {exc}") from exc
    if set(tensors) != set(_TENSOR_NAMES):
        raise CacheEntryError(
            f"entry holds tensors {sorted(tensors)}, expected {sorted(_TENSOR_NAMES)}"
        )
    token_ids, keys, values = (tensors[name] for name in _TENSOR_NAMES)
    if token_ids.dtype != torch.int64:
        raise CacheEntryError(f"entry token_ids are {token_ids.dtype}, expected torch.int64")
    if keys.dtype != values.dtype:
        raise CacheEntryError(f"entry keys are {keys.dtype} but values are {values.dtype}")
    if _checksum(token_ids, keys, values) != metadata["checksum"]:
        raise CacheEntryError("entry checksum mismatch: the tensor bytes are corrupt")
    try:
        kv = ChunkKV(
            token_ids=token_ids, keys=keys, values=values, fingerprint=metadata["fingerprint"]
        )
    except ValueError as exc:  # shape checks live in ChunkKV itself
        raise CacheEntryError(f"entry shapes are inconsistent: {exc}") from exc
    if cache_key(kv.fingerprint, token_ids) != metadata["key"]:
        raise CacheEntryError("entry key does not match its fingerprint and token ids")
    return kv
