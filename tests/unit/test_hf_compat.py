"""One compatibility layer for transformers internals, and the load-time self-check.

Every transformers internal goes through ``engine/modeling/hf_compat.py``; reuse that a
release breaks is refused at load (``UnsupportedModelError`` naming the
versions), never run: checked here by faking the breakages a release causes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import transformers

import kvrag_integrations
from kvrag_integrations import KVRAGEngine, UnsupportedModelError
from kvrag_integrations.engine.modeling import hf_compat
from kvrag_integrations.engine.modeling.forward import PromptCache
from kvrag_integrations.engine.modeling.model import LoadedModel, load_model
from kvrag_integrations.engine.modeling.self_check import check_reuse

INTERNAL = (
    "transformers.cache_utils",
    "transformers.masking_utils",
    "transformers.modeling_utils",
    "transformers.integrations",
)
PACKAGE = Path(kvrag_integrations.__file__).parent


def _internal_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        found += [n for n in names if n.startswith(INTERNAL)]
    return found


def test_only_the_compatibility_module_imports_transformers_internals() -> None:
    offenders = {
        str(path.relative_to(PACKAGE)): hits
        for path in PACKAGE.rglob("*.py")
        if path.name != "hf_compat.py" and (hits := _internal_imports(path))
    }
    assert offenders == {}
    # The scan does find them.
    assert _internal_imports(PACKAGE / "engine" / "modeling" / "hf_compat.py")


def test_self_check_passes_on_the_model_and_is_exact_in_float32(tiny_loaded: LoadedModel) -> None:
    error = check_reuse(tiny_loaded.model, tiny_loaded.layout)
    assert error < 1e-5


def test_cache_argument_names_what_the_model_takes(tiny_loaded: LoadedModel) -> None:
    import inspect

    params = inspect.signature(type(tiny_loaded.model).forward).parameters
    (name,) = hf_compat.cache_argument(tiny_loaded.model, None)
    assert name in params
    assert name == ("cache" if "cache" in params else "past_key_values")


def test_a_cache_that_takes_no_extra_arguments_is_refused_at_load(
    tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every 5.x release passes an extra argument to ``update`` (``cache_kwargs``
    positionally before 5.24, ``kwargs=`` from 5.24): a cache that drops the
    unknown keyword's slot is what broke 5.24."""

    def strict_update(self, key_states, value_states, layer_idx):  # the pre-fix signature
        return self.write(key_states, value_states, layer_idx)

    monkeypatch.setattr(PromptCache, "update", strict_update)
    with pytest.raises(UnsupportedModelError) as err:
        check_reuse(tiny_loaded.model, tiny_loaded.layout)
    message = str(err.value)
    assert f"transformers {transformers.__version__}" in message
    assert f"torch {torch.__version__}" in message
    assert 'strategy="full"' in message and "TypeError" in message


def test_a_cache_that_loses_the_cached_tokens_is_refused(
    tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release that runs but answers wrongly (here: the cached rows read as zeros)."""
    real_write = PromptCache.write

    def cached_rows_lost(self, key_states, value_states, layer_idx):
        keys, values = (t.clone() for t in real_write(self, key_states, value_states, layer_idx))
        first = int(self.writer.rows.min())
        keys[:, :, :first] = 0
        values[:, :, :first] = 0
        return keys, values

    monkeypatch.setattr(PromptCache, "write", cached_rows_lost)
    with pytest.raises(UnsupportedModelError, match="differs from the model's own forward"):
        check_reuse(tiny_loaded.model, tiny_loaded.layout)


@pytest.fixture(scope="module")
def saved_tiny(tiny_loaded: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-model")
    tiny_loaded.model.save_pretrained(folder)
    tiny_loaded.tokenizer.save_pretrained(folder)
    return folder


def test_load_refuses_a_broken_release_and_reuse_false_still_answers_by_full(
    saved_tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert load_model(saved_tiny).layout.reuse_refused is None  # the real one passes

    def strict_update(self, key_states, value_states, layer_idx):
        return self.write(key_states, value_states, layer_idx)

    monkeypatch.setattr(PromptCache, "update", strict_update)
    with pytest.raises(UnsupportedModelError, match="self-check"):
        load_model(saved_tiny)
    engine = KVRAGEngine(load_model(saved_tiny, reuse=False), on_miss="encode")
    chunks = ["Canberra is the capital of Australia."]
    full = engine.generate(question="Capital?", chunks=chunks, strategy="full", max_new_tokens=3)
    assert full.generated_tokens == 3
    with pytest.raises(UnsupportedModelError, match="reuse=False"):
        engine.generate(question="Capital?", chunks=chunks, strategy="turbo", max_new_tokens=3)


def test_gguf_read_once_parses_each_file_once_and_undoes_itself(tmp_path: Path) -> None:
    """transformers reads a GGUF file three times on a first load (config,
    tokenizer, weights); within ``gguf_read_once`` each read gets the one parse."""
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(50)])
    writer.add_tensor("token_embd.weight", torch.arange(12, dtype=torch.float32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    original = gguf.GGUFReader
    arch = next(iter(gguf.MODEL_ARCH_NAMES))
    with hf_compat.gguf_read_once():
        first = gguf.GGUFReader(str(path))
        assert gguf.GGUFReader(path) is first  # a str and a Path of one file
        assert gguf.GGUFReader(str(path), "r+") is not first  # another mode reads anew
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        assert gguf.get_tensor_name_map(arch, 2) is not gguf.get_tensor_name_map(arch, 3)
    assert gguf.GGUFReader is original
    assert len(first.fields["tokenizer.ggml.tokens"].data) == 50  # the file, parsed
    assert gguf.GGUFReader(str(path)) is not first
    with pytest.raises(RuntimeError), hf_compat.gguf_read_once():
        raise RuntimeError("a failed load")
    assert gguf.GGUFReader is original
