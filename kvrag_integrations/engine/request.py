"""A request's options and the checked request every engine answers.

``RequestOptions`` is how a request is answered (strategy and its options,
sampling, miss policy, log-probabilities) and the one place where a call's
options are merged with defaults: the engine's own, or an adapter's instance
settings. ``Request`` is a checked, tokenized request
(``EngineFrontend.prepare`` makes it, on the caller's thread); each engine's
job answers it (``in_process.answer``, ``VLLMEngine``'s).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvrag_integrations.engine.modeling.sampling import SAMPLING_ARGS, SamplingParams, check_int
from kvrag_integrations.engine.prompting.segments import TokenizedPrompt
from kvrag_integrations.engine.scheduling.miss_policy import ON_MISS, check_on_miss
from kvrag_integrations.engine.strategies import DEFAULT_STRATEGY, Strategy, make_strategy
from kvrag_integrations.engine.tools.plan import (
    ToolPlan,
    check_parallel,
    check_tool_choice,
    check_tools,
)

__all__ = ["ON_MISS", "Request", "RequestOptions", "check_on_miss"]


@dataclass(frozen=True)
class RequestOptions:
    """How one request is answered: its strategy (with options), sampling, miss
    policy and the first token's log-probabilities.

    ``RequestOptions()`` holds the engine's defaults. Everything that answers
    requests merges into them with ``merged``: the engine a call's keywords, an
    adapter its instance settings and then each call's options, having
    translated its framework's names (LangChain's ``max_tokens``, ...) to the
    engine's. Every instance is checked when made, before any retrieval or
    forward: a bad sampling value raises ``TypeError`` or ``ValueError`` naming
    the argument (``SamplingParams``), an unknown strategy
    ``UnknownStrategyError``, an option the strategy does not take
    ``TypeError`` (``make_strategy``), a bad ``on_miss`` ``ValueError``.
    ``on_miss=None`` is the engine's own policy. ``logprobs=k`` asks for the
    first generated token's ``k`` likeliest log-probabilities
    (``GenerationResult.first_token_logprobs``; an int >= 1, else ``TypeError``
    or ``ValueError``); None, none. ``tools``: OpenAI function schemas the
    model may call (``tools.plan.check_tools``); ``tool_choice``:
    ``"auto"`` (None), ``"required"``, ``"none"`` or a tool's name (or OpenAI's
    named form), checked against them; ``parallel_tool_calls``: None or True,
    every call the model writes, False the first only.

    Examples:
        >>> blend = RequestOptions().merged(
        ...     {"strategy": "blend", "strategy_options": {"recompute_ratio": 0.3}}
        ... )
        >>> blend.merged({"temperature": 0.5}).strategy_options
        {'recompute_ratio': 0.3}
        >>> blend.merged({"strategy": "turbo"}).strategy_options  # not blend's options
        {}
        >>> blend.merged({"check_layer": 2}).as_kwargs()["check_layer"]
        2
        >>> RequestOptions().merged({"top_p": 0.0})
        Traceback (most recent call last):
        ...
        ValueError: top_p must be in (0, 1], got 0.0
    """

    strategy: str | Strategy = DEFAULT_STRATEGY
    strategy_options: dict[str, Any] = field(default_factory=dict)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    on_miss: str | None = None
    logprobs: int | None = None
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"sampling must be SamplingParams, got {type(self.sampling).__name__}")
        if self.on_miss is not None:
            check_on_miss(self.on_miss)
        if self.logprobs is not None:
            object.__setattr__(self, "logprobs", check_int("logprobs", self.logprobs, minimum=1))
        object.__setattr__(self, "tools", check_tools(self.tools))
        check_tool_choice(self.tool_choice, self.tools)
        check_parallel(self.parallel_tool_calls)
        object.__setattr__(self, "strategy_options", _option_dict(self.strategy_options))
        make_strategy(self.strategy, **self.strategy_options)

    def merged(self, call: Mapping[str, Any]) -> RequestOptions:
        """These options overridden by ``call`` (the engine's argument names).

        ``strategy``, ``on_miss``, ``logprobs``, ``tools``, ``tool_choice``,
        ``parallel_tool_calls`` and the
        sampling arguments (``SAMPLING_ARGS``)
        replace their values (None too: an adapter whose framework means "not
        given" by None leaves the key out). ``strategy_options`` (a mapping;
        None: none given) and every other key are strategy options: they update
        the inherited ones, which are these options' when ``call`` keeps this
        strategy and none when it names another (a default's options belong to
        the default's strategy).
        """
        call = dict(call)
        given = call.pop("strategy_options", None)
        sampling = {name: call.pop(name) for name in SAMPLING_ARGS if name in call}
        changed = {name: call.pop(name) for name in _REPLACED if name in call}
        sampling_params = replace(self.sampling, **sampling)  # sampling is checked first
        strategy = changed.get("strategy", self.strategy)
        options = dict(self.strategy_options) if strategy == self.strategy else {}
        options.update(_option_dict(given) if given is not None else {})
        options.update(call)  # what is left: strategy options passed as keywords
        return replace(self, **changed, strategy_options=options, sampling=sampling_params)

    def as_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``engine.generate`` / ``stream`` / ``astream``:
        the strategy, its options as keywords, the sampling arguments, ``on_miss``
        and ``logprobs`` when asked for."""
        kwargs: dict[str, Any] = {"strategy": self.strategy, **self.strategy_options}
        kwargs.update({name: getattr(self.sampling, name) for name in SAMPLING_ARGS})
        kwargs["on_miss"] = self.on_miss
        if self.logprobs is not None:
            kwargs["logprobs"] = self.logprobs
        if self.tools:
            kwargs["tools"] = list(self.tools)
        if self.tool_choice is not None:
            kwargs["tool_choice"] = self.tool_choice
        if self.parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = self.parallel_tool_calls
        return kwargs


# request options that are not the strategy's
_REPLACED = ("strategy", "on_miss", "logprobs", "tools", "tool_choice", "parallel_tool_calls")


def _option_dict(options: Any) -> dict[str, Any]:
    """``strategy_options`` as a new dict; anything but a mapping is a ``TypeError``."""
    if not isinstance(options, Mapping):
        raise TypeError(
            f"strategy_options must be a mapping of option names, got {type(options).__name__}"
        )
    return dict(options)


@dataclass
class Request:
    """A checked request: its strategy, tokenized prompt, miss policy (the engine's
    where the call named none), start time, sampling and log-probabilities asked for;
    its tools (None: none) and, where a call is forced, the call's start the
    prompt ends with past the opening markup (``lead``: ``EngineFrontend.forced_lead``);
    ``strategy_options``: the call's own options of its strategy (an engine whose
    strategy runs elsewhere passes them on, under that side's defaults)."""

    strategy: Strategy
    prompt: TokenizedPrompt
    on_miss: str
    started: float
    sampling: SamplingParams = field(default_factory=SamplingParams)
    logprobs: int | None = None
    tools: ToolPlan | None = None
    lead: str = ""
    strategy_options: dict[str, Any] = field(default_factory=dict)
