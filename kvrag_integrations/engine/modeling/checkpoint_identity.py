"""What identifies a checkpoint on disk, read from its files: both engines agree on it.

vLLM holds the weights in its own modules (fused projections, sharded), so the
in-process engine's fingerprint (``model_fingerprint``, over transformers'
parameters) cannot be taken there. This one is taken from the checkpoint folder
both engines load (``model.checkpoint_folder``: a Hugging Face id's snapshot, a
directory, a ``.gguf``'s dequantized copy): its config, its tokenizer files and a
strided sample of every weight file's bytes (any fine-tune or merged adapter
changes it). The vLLM connector keys its entries by it (with the dtype and
precision: ``vllm.identity``); a model's calibrated settings are recorded under
it (``engine.blend_settings``), so every process serving those files reads them.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

# Files that make the tokenizer (their bytes are hashed).
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# Config fields that say where or when a checkpoint was written, not what it is.
_VOLATILE = ("_name_or_path", "_model_name_or_path", "transformers_version", "_commit_hash")
# ... and a tokenizer config's (how it was loaded when saved: a copy made by another
# transformers release writes them differently).
_TOKENIZER_VOLATILE = (*_VOLATILE, "name_or_path", "local_files_only", "cache_dir", "token")
_SAMPLES = 64  # strided samples per weight file
_SAMPLE_BYTES = 256


def local_folder(model: str | os.PathLike[str], revision: str | None = None) -> Path:
    """The local folder of a checkpoint (a directory, or a Hugging Face id already in
    the local cache).

    Raises:
        FileNotFoundError: neither.
    """
    path = Path(model)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(model), revision=revision, local_files_only=True))
    except Exception as exc:
        raise FileNotFoundError(
            f"no local checkpoint folder for {model!r} (a local directory, or a Hugging "
            f"Face id in the local cache): {exc}"
        ) from exc


def folder_fingerprint(
    folder: str | os.PathLike[str],
    tag: str,
    extra: str = "",
    *,
    weights: bool = True,
    canonical: bool = False,
) -> str:
    """A short hash of ``tag``, a checkpoint folder's config, tokenizer and weights,
    and ``extra``.

    Weight files are identified by name, size and ``_SAMPLES`` strided samples
    of their bytes (cheap for any size: a few reads per file). ``weights=False``
    for weights not read from the folder (vLLM's ``load_format="dummy"``:
    random ones, which ``extra`` must then name). ``canonical``: JSON tokenizer
    files hashed as their content without how they were loaded
    (``_TOKENIZER_VOLATILE``), so copies saved by other transformers releases
    agree (the connector's keys hash the files' bytes, as they always have).

    Examples:
        >>> import tempfile, pathlib
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     _ = (pathlib.Path(tmp) / "config.json").write_text('{"model_type": "llama"}')
        ...     _ = (pathlib.Path(tmp) / "model.safetensors").write_bytes(bytes(range(256)) * 8)
        ...     a = folder_fingerprint(tmp, "t")
        ...     _ = (pathlib.Path(tmp) / "model.safetensors").write_bytes(bytes(2048))
        ...     a != folder_fingerprint(tmp, "t")
        True

    Raises:
        FileNotFoundError: no ``config.json``, or no weight file where ``weights``.
    """
    root = Path(folder)
    digest = hashlib.sha256(tag.encode())
    config = json.loads((root / "config.json").read_text())
    for volatile in _VOLATILE:
        config.pop(volatile, None)
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name in _TOKENIZER_FILES:
        path = root / name
        if path.is_file():
            data = path.read_bytes()
            if canonical and name.endswith(".json"):
                data = _canonical_json(data)
            digest.update(f"|{name}|".encode() + hashlib.sha256(data).digest())
    files = sorted(p for p in root.iterdir() if p.suffix in _WEIGHT_SUFFIXES and p.is_file())
    if weights and not files:
        raise FileNotFoundError(f"no weight files in {root}")
    for path in files if weights else ():
        digest.update(f"|{path.name}|{path.stat().st_size}|".encode())
        digest.update(_sample(path))
    digest.update(f"|{extra}".encode())
    return digest.hexdigest()[:32]


def _canonical_json(data: bytes) -> bytes:
    """A JSON file's content sorted, without ``_TOKENIZER_VOLATILE`` (as is if not JSON)."""
    try:
        content = json.loads(data)
    except ValueError:
        return data
    if isinstance(content, dict):
        content = {k: v for k, v in content.items() if k not in _TOKENIZER_VOLATILE}
    return json.dumps(content, sort_keys=True, default=str).encode()


def _sample(path: Path) -> bytes:
    size = path.stat().st_size
    step = max(1, size // _SAMPLES)
    out = bytearray()
    with path.open("rb") as handle:
        for offset in range(0, size, step)[:_SAMPLES]:
            handle.seek(offset)
            out += handle.read(_SAMPLE_BYTES)
    return bytes(out)


MODEL_TAG = "model"


def model_identity(loaded: Any) -> str:
    """What both engines name a model's weights by (its calibration's key): its
    checkpoint folder's ``folder_fingerprint`` with the merged adapter's identity,
    else (weights given in memory, no folder) its in-process fingerprint."""
    if loaded.checkpoint is not None:
        try:
            folder = local_folder(loaded.checkpoint)
            return folder_fingerprint(folder, MODEL_TAG, loaded.adapter, canonical=True)
        except (OSError, ValueError):  # no folder here (an id not in the local cache)
            pass
    return "inprocess-" + str(loaded.fingerprint)[:32]
