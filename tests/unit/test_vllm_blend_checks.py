"""Which models blend runs on inside vLLM (``connector.blend.check_model``), with vLLM's
own attention layers (the vLLM lane: needs vLLM).

Blend runs vLLM's own model code for the recomputed rows and only the attention is
ours, so what it refuses is attention it does not reproduce: ALiBi, attention
sinks, a layer that is not vLLM's ``Attention``, a model whose forward takes no
token ids and positions. A server started with ``--reuse blend`` stops with the
reason (``server.startup.attach_model``; a turbo server then encodes an anonymous
request's own texts instead of computing them in place); ``VLLMEngine`` refuses
blend at the call.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (the vLLM lane of .ci/run has it)")

from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.attention.attention import Attention

from kvrag_integrations.model_files import checkpoint_folder
from kvrag_integrations.vllm.connector.blend import check_model


class Model(torch.nn.Module):
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return input_ids


class NoPositions(torch.nn.Module):
    def forward(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        return inputs_embeds


@pytest.fixture(scope="module")
def config() -> VllmConfig:
    folder, _ = checkpoint_folder(None)  # the bundled model's config: vLLM's needs one
    return VllmConfig(model_config=ModelConfig(model=folder, dtype="float32"))


def layer(config: VllmConfig, index: int, **extra: object) -> Attention:
    with set_current_vllm_config(config):
        return Attention(
            4, 16, 0.25, num_kv_heads=2, prefix=f"model.layers.{index}.self_attn.attn", **extra
        )


def test_vllms_own_attention_is_taken(config: VllmConfig) -> None:
    assert check_model(Model(), {0: layer(config, 0), 1: layer(config, 1)}, config) == ""


def test_attention_blend_does_not_reproduce_is_refused_by_name(config: VllmConfig) -> None:
    plain = layer(config, 10)  # (layer names are the config's: one per test here)
    alibi = layer(config, 11, alibi_slopes=[0.1, 0.2, 0.3, 0.4])
    sinks = layer(config, 12, sinks=torch.zeros(4))
    assert check_model(Model(), {0: plain, 1: alibi}, config) == "Model layer 1 uses ALiBi"
    assert check_model(Model(), {2: sinks}, config) == "Model layer 2 has attention sinks"
    linear = torch.nn.Linear(2, 2)
    assert "is not vLLM's Attention" in check_model(Model(), {0: linear}, config)
    assert "takes no input_ids and positions" in check_model(NoPositions(), {0: plain}, config)
