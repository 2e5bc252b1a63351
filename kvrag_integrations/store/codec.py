"""Byte format of one stored ``ChunkKV``: safetensors plus an integrity code, never pickle.

An entry (format v3, :data:`FORMAT_VERSION`) is a safetensors blob with the
tensors ``token_ids``, ``keys`` and ``values`` (and, for int8 entries,
``key_scale``, ``key_zero``, ``value_scale``, ``value_zero``) and string metadata:
``format``, ``fingerprint``, ``key`` (the entry's ``cache_key``), ``precision``
(the storage form: ``float32``, ``float16``, ``bfloat16`` or ``int8``),
``integrity`` (the code's algorithm) and ``checksum``. The code covers
everything the decoder trusts: the format, fingerprint, key and precision, each
tensor's name, dtype and shape as the header states them, and the payload
bytes. So a header edit that keeps the bytes (a dtype or shape rewritten) fails
it, not only a flipped payload byte.

The code is xxh3-128 (fast: ~20 GB/s, against accidents) or, when the store
has a secret, HMAC-SHA256 keyed with it (against anyone who can write to the
store but does not hold the secret). An entry made one way is refused by a
store configured the other way.

Decoding copies nothing: the header is parsed and checked here (names, dtypes,
shapes, offsets inside the buffer, no overlap, alignment), the code is computed
over slices of the entry's buffer, and only then are tensors made with
``torch.frombuffer`` over that buffer (a ``bytearray`` from disk, ``bytes`` from
Redis: the tensors are then read-only views, which nothing writes into).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import struct
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import safetensors.torch
import torch
import xxhash

from kvrag_integrations.chunk_kv import FORMAT_VERSION, QUANT_NAMES, ChunkKV, cache_key
from kvrag_integrations.errors import CacheEntryError

# The environment variable a store reads its secret from when none is given.
SECRET_ENV = "KVRAG_STORE_SECRET"

_TENSOR_NAMES = ("token_ids", "keys", "values")
_ALL_NAMES = _TENSOR_NAMES + QUANT_NAMES
_METADATA_NAMES = ("format", "fingerprint", "key", "checksum")
# safetensors dtype names this decoder can size (anything else is refused unread).
_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_PRECISIONS = ("float32", "float16", "bfloat16", "int8")
_FROMBUFFER_LOCK = threading.Lock()


@dataclass(frozen=True)
class _Slice:
    """One tensor as the header declares it, over the entry's buffer (not yet a tensor)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the buffer
    payload: memoryview


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
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # any dtype, even empty


def _described(item: torch.Tensor | _Slice) -> tuple[torch.dtype, tuple[int, ...], memoryview]:
    if isinstance(item, _Slice):
        return item.dtype, item.shape, item.payload
    return item.dtype, tuple(item.shape), _payload(item)


def _form(tensors: Mapping[str, torch.Tensor | _Slice]) -> str:
    """The storage form the tensors have: ``int8`` with scales, else the K/V dtype."""
    if "key_scale" in tensors:
        return "int8"
    return str(_described(tensors["keys"])[0]).removeprefix("torch.")


def _checksum(
    metadata: Mapping[str, str],
    tensors: Mapping[str, torch.Tensor | _Slice],
    secret: bytes | None,
) -> tuple[str, str]:
    """``(integrity, code)`` over the metadata the decoder trusts (format,
    fingerprint, key, precision), each tensor's name, dtype and shape, and the payload.

    ``tensors`` are tensors (encoding) or header-declared slices of the entry's
    buffer (decoding); the precision is the metadata's, else the tensors' form.
    """
    names = [n for n in _ALL_NAMES if n in tensors]
    items = {n: _described(tensors[n]) for n in names}
    described = {
        "format": metadata["format"],
        "fingerprint": metadata["fingerprint"],
        "key": metadata["key"],
        "precision": metadata.get("precision") or _form(tensors),
        "tensors": [[n, str(items[n][0]), list(items[n][1])] for n in names],
    }
    head = json.dumps(described, sort_keys=True).encode("utf-8")
    if secret is None:
        digest, integrity = xxhash.xxh3_128(), "xxh3-128"
    else:
        digest, integrity = hmac.new(secret, digestmod=hashlib.sha256), "hmac-sha256"
    digest.update(struct.pack("<Q", len(head)) + head)
    for name in names:
        digest.update(items[name][2])
    return integrity, digest.hexdigest()


def encode_entry(kv: ChunkKV, secret: bytes | None = None) -> bytes:
    """Serialize ``kv`` to self-verifying safetensors bytes.

    Args:
        kv: the entry in its storage form (float32, float16, bfloat16 K/V, or
            int8 codes with their scales and zero points).
        secret: sign with HMAC-SHA256 under this key (see :func:`store_secret`);
            None: an xxh3-128 checksum.

    Returns:
        The bytes that :func:`decode_entry` turns back into an equal ``ChunkKV``.
    """
    tensors = {name: t.detach().cpu().contiguous() for name, t in kv.tensors().items()}
    tensors["token_ids"] = tensors["token_ids"].to(torch.int64)
    metadata = {
        "format": FORMAT_VERSION,
        "fingerprint": kv.fingerprint,
        "key": kv.key,
        "precision": kv.precision,
    }
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
    (header_len,) = struct.unpack("<Q", bytes(first8[:8]))
    return int(header_len)


def _header(data: bytes | bytearray | memoryview) -> dict:
    """The JSON header of an entry from (at least) its first ``8 + header_length`` bytes:
    8 bytes little-endian header length, then the header itself."""
    header_len = header_length(data)
    if header_len > len(data) - 8:
        raise CacheEntryError("entry is truncated: header runs past the end of the data")
    try:
        header = json.loads(bytes(data[8 : 8 + header_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CacheEntryError(f"entry header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise CacheEntryError("entry header is not a JSON object")
    return header


def entry_size(head: bytes | bytearray | memoryview) -> int:
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


def read_metadata(data: bytes | bytearray | memoryview) -> dict[str, str]:
    """The entry's metadata (``format``, ``fingerprint``, ``key``, ``checksum``, and
    from format v2 ``integrity``, from v3 ``precision``), unverified.

    Only the header is parsed, so ``data`` may be just the entry's first
    ``8 + header_length(data[:8])`` bytes: stores use it to describe an entry
    without reading its tensors.

    Raises:
        CacheEntryError: the header is truncated, not JSON or lacks a field.
    """
    return _metadata(_header(data))


def _metadata(header: dict) -> dict[str, str]:
    metadata = header.get("__metadata__")
    if not isinstance(metadata, dict):
        raise CacheEntryError("entry has no metadata")
    missing = [name for name in _METADATA_NAMES if not isinstance(metadata.get(name), str)]
    if missing:
        raise CacheEntryError(f"entry metadata lacks {', '.join(missing)}")
    return metadata


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _slices(data: bytes | bytearray | memoryview, header: dict) -> dict[str, _Slice]:
    """Each tensor the header declares, checked against the buffer before any use:
    a dtype this decoder knows, a shape of non-negative ints, offsets whose span is
    exactly the shape's bytes, and spans that tile the payload from 0 to its end
    (inside the buffer, no overlap, no gap), as safetensors requires."""
    base = 8 + header_length(data)
    size = len(data) - base
    view = memoryview(data).cast("B") if isinstance(data, memoryview) else memoryview(data)
    slices: dict[str, _Slice] = {}
    spans: list[tuple[int, int]] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise CacheEntryError(f"entry header entry {name!r} is not an object")
        dtype = _ST_DTYPES.get(info.get("dtype"))  # type: ignore[arg-type]
        if dtype is None:
            raise CacheEntryError(f"entry tensor {name!r} has an unknown dtype")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list) or not all(_is_size(d) for d in shape):
            raise CacheEntryError(f"entry tensor {name!r} has a bad shape")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_size, offsets)):
            raise CacheEntryError(f"entry tensor {name!r} has bad offsets")
        start, end = offsets
        itemsize = torch.empty((), dtype=dtype).element_size()
        if end - start != math.prod(shape) * itemsize:
            raise CacheEntryError(f"entry tensor {name!r}: offsets do not match dtype and shape")
        spans.append((start, end))
        slices[name] = _Slice(dtype, tuple(shape), base + start, view[base + start : base + end])
    position = 0
    for start, end in sorted(spans):
        if start != position:
            raise CacheEntryError("entry tensors overlap or leave gaps")
        position = end
    if position != size:
        raise CacheEntryError(
            f"entry payload is {size} bytes, its header declares {position}: truncated or padded"
        )
    return slices


def _tensor(data: bytes | bytearray | memoryview, item: _Slice) -> torch.Tensor:
    """A tensor over ``item``'s bytes of ``data``, without a copy (checked before)."""
    count = math.prod(item.shape)
    if count == 0:
        return torch.empty(item.shape, dtype=item.dtype)
    if memoryview(data).readonly:
        # Redis hands back bytes: torch warns that it cannot make read-only tensors.
        # Nothing writes into stored tensors (they are cast or copied on use), so the
        # warning is silenced here, for this call only.
        with _FROMBUFFER_LOCK, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            flat = torch.frombuffer(data, dtype=item.dtype, count=count, offset=item.start)
    else:
        flat = torch.frombuffer(data, dtype=item.dtype, count=count, offset=item.start)
    if flat.data_ptr() % flat.element_size():  # never for our entries (safetensors aligns)
        flat = flat.clone()
    return flat.view(item.shape)


def decode_entry(data: bytes | bytearray | memoryview, secret: bytes | None = None) -> ChunkKV:
    """Parse and verify bytes made by :func:`encode_entry`, without copying the payload.

    Args:
        data: the stored bytes; the returned tensors are views of them (a
            ``bytearray`` gives writable tensors, ``bytes`` read-only ones).
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
    header = _header(data)
    metadata = _metadata(header)
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
    slices = _slices(data, header)
    precision = metadata.get("precision")
    if precision is None:
        precision = "int8" if "key_scale" in slices else None
    names = _TENSOR_NAMES + (QUANT_NAMES if precision == "int8" else ())
    if set(slices) != set(names):
        raise CacheEntryError(f"entry holds tensors {sorted(slices)}, expected {sorted(names)}")
    _, code = _checksum(metadata, slices, secret)
    if not hmac.compare_digest(code, metadata["checksum"]):
        raise CacheEntryError(
            "entry checksum mismatch: the integrity check over its header and tensor bytes failed"
        )
    precision = precision or _form(slices)
    _check_dtypes(slices, precision)
    tensors = {name: _tensor(data, item) for name, item in slices.items()}
    try:
        kv = ChunkKV(fingerprint=metadata["fingerprint"], **tensors)
    except ValueError as exc:  # shape checks live in ChunkKV itself
        raise CacheEntryError(f"entry shapes are inconsistent: {exc}") from exc
    if cache_key(kv.fingerprint, kv.token_ids) != metadata["key"]:
        raise CacheEntryError("entry key does not match its fingerprint and token ids")
    return kv


def _check_dtypes(slices: Mapping[str, _Slice], precision: str) -> None:
    """Each tensor's dtype is the one its role and the entry's precision allow."""
    if precision not in _PRECISIONS:
        raise CacheEntryError(f"entry precision {precision!r} is not one of {_PRECISIONS}")
    allowed = {"token_ids": torch.int64}
    if precision == "int8":
        allowed |= {"keys": torch.uint8, "values": torch.uint8}
        allowed |= dict.fromkeys(QUANT_NAMES, torch.float16)
    else:
        allowed |= dict.fromkeys(("keys", "values"), getattr(torch, precision))
    for name, dtype in allowed.items():
        if slices[name].dtype != dtype:
            raise CacheEntryError(
                f"entry {name} are {slices[name].dtype}, expected {dtype} ({precision} entry)"
            )
