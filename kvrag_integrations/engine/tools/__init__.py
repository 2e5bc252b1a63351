"""Tool calling: one ``ToolFamily`` per call format, the request's plan, calls as values.

``plan`` checks tools and ``tool_choice`` and picks the family; ``family`` is
the base class and the shared readers, one module per format (``hermes``,
``llama``, ``mistral``, ``pythonic``); ``calls`` the values; ``json_text`` JSON
read from untrusted output without raising; ``constraint`` a forced call's
decoding. Nothing here imports another engine sub-package.
"""

from kvrag_integrations.engine.tools.calls import (
    InvalidToolCall,
    Parsed,
    ToolCall,
    message_tool_fields,
)
from kvrag_integrations.engine.tools.family import ToolFamily
from kvrag_integrations.engine.tools.plan import FAMILIES, ToolPlan, family_for, plan_tools

__all__ = [
    "FAMILIES",
    "InvalidToolCall",
    "Parsed",
    "ToolCall",
    "ToolFamily",
    "ToolPlan",
    "family_for",
    "message_tool_fields",
    "plan_tools",
]
