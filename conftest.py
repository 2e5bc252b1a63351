"""Collection rules for the whole repository (the package's doctests included).

The vLLM connector module subclasses vLLM's connector base, so it imports only
where vLLM is installed (the vLLM lane of ``.ci/run``); elsewhere its doctests
are not collected. Every other vLLM module of the package imports without vLLM.
"""

import importlib.util

collect_ignore_glob = (
    []
    if importlib.util.find_spec("vllm")
    else ["kvrag_integrations/vllm/connector/kv_connector.py"]
)
