"""ChatKVRAG's answers to the property flags of LangChain's standard suites.

Shared by the unit suite (tests/unit/test_langchain_standard_unit.py, on the
tiny model) and the integration suite
(tests/integration/test_langchain_standard.py, on the real model), so both
describe the same model class.
"""

from __future__ import annotations

from kvrag_integrations.langchain import ChatKVRAG


class ChatKVRAGFlags:
    """Mixed into a ``ChatModelUnitTests`` or ``ChatModelIntegrationTests`` subclass."""

    @property
    def chat_model_class(self) -> type[ChatKVRAG]:
        return ChatKVRAG

    # What a local text-only 135M chat model has and has not.
    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return False

    @property
    def supports_json_mode(self) -> bool:
        return False

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def supports_audio_inputs(self) -> bool:
        return False

    @property
    def supports_pdf_inputs(self) -> bool:
        return False

    @property
    def supports_video_inputs(self) -> bool:
        return False

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[str]]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    @property
    def supports_model_override(self) -> bool:
        return True
