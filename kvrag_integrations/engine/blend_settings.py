"""Blend's settings per model, as calibration measured them, and where engines read them.

CacheBlend's best settings depend on the model and on the prompt's shape
(docs/benchmarks.md, "CacheBlend"): which entries it reads (chunks encoded
alone or behind the model's BOS), how it selects the tokens it recomputes (by
their K/V's deviation, or by the question's attention), how many (the
recompute ratio) and whether each chunk's first tokens are recomputed too
(EPIC). ``kvrag calibrate`` (``kvrag_integrations.calibration``) measures the
candidates on a sample of the user's own chunks against full prefill and keeps
the cheapest that meets its bound, for the sample's chunk length: a
``Calibration`` holds one ``CalibratedChoice`` per chunk length measured.

The record is kept in the store, under the model's checkpoint identity
(``checkpoint_identity.folder_fingerprint`` of the files both engines load), so
every process and replica serving that model reads the same choice: the
in-process engine (``Calibrations``) and the vLLM connector alike. The bundled
models ship theirs (``data/calibrations.json``). A model never calibrated keeps
``CacheBlend``'s own defaults and says so once in the log, with the command that
calibrates it.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from functools import cache
from importlib import resources
from typing import Any

from kvrag_integrations.engine.prompting.segments import CHUNK_CONTEXTS, TokenizedPrompt
from kvrag_integrations.errors import CalibrationError

logger = logging.getLogger(__name__)

SELECTIONS = ("deviation", "query")
RECORD_PREFIX = "calibration:"
FORMAT = 1
REREAD_S = 60.0  # a store's record is read again after this long (a new calibration)


@dataclass(frozen=True)
class BlendSettings:
    """What calibration chooses for ``CacheBlend`` (``strategy_options``).

    Attributes:
        chunk_context: the entries blend reads (``"alone"`` or ``"sink"``); where it
            differs from the engine's own, they are other entries, kept apart.
        selection: ``"deviation"`` (CacheBlend's K/V drift at its check layer) or
            ``"query"`` (the tokens the question attends to most).
        recompute_ratio: the share of chunk tokens recomputed.
        recompute_first: each chunk's first tokens recomputed too (EPIC).

    Examples:
        >>> s = BlendSettings("sink", "query", 0.2)
        >>> s.strategy_options()["selection"], BlendSettings.from_json(s.as_json()) == s
        ('query', True)
        >>> BlendSettings("sink", "query", 1.5)
        Traceback (most recent call last):
        ...
        kvrag_integrations.errors.CalibrationError: recompute_ratio must be in [0, 1], got 1.5
    """

    chunk_context: str = "alone"
    selection: str = "deviation"
    recompute_ratio: float = 0.15
    recompute_first: int = 0

    def __post_init__(self) -> None:
        if self.chunk_context not in CHUNK_CONTEXTS:
            raise CalibrationError(f"chunk_context must be one of {CHUNK_CONTEXTS}")
        if self.selection not in SELECTIONS:
            raise CalibrationError(f"selection must be one of {SELECTIONS}")
        ratio = self.recompute_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
            raise CalibrationError(f"recompute_ratio must be in [0, 1], got {ratio!r}")
        first = self.recompute_first
        if isinstance(first, bool) or not isinstance(first, int) or not 0 <= first <= 64:
            raise CalibrationError(f"recompute_first must be an int in [0, 64], got {first!r}")
        object.__setattr__(self, "recompute_ratio", float(ratio))

    def strategy_options(self) -> dict[str, Any]:
        """``CacheBlend``'s keyword arguments for these settings."""
        return asdict(self)

    @property
    def label(self) -> str:
        """``blend@0.15(sink, query)``: a table row's name."""
        first = f", first {self.recompute_first}" if self.recompute_first else ""
        return f"blend@{self.recompute_ratio:g}({self.chunk_context}, {self.selection}{first})"

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Any) -> BlendSettings:
        """Settings from a record's JSON (``CalibrationError`` if malformed)."""
        fields = ("chunk_context", "selection", "recompute_ratio", "recompute_first")
        if not isinstance(raw, Mapping) or set(raw) != set(fields):
            raise CalibrationError(f"blend settings must have exactly the fields {fields}")
        return cls(**{name: raw[name] for name in fields})


@dataclass(frozen=True)
class CalibratedChoice:
    """The settings chosen for prompts of chunks of about ``chunk_tokens`` tokens, with
    what was measured on the calibration's sample (first-token KL to full prefill,
    blend's and turbo's; their greedy answers' token F1 against full's; and blend's
    time to first token as a share of full's).

    ``by_context``: the best settings found for each encoding context measured (an
    engine whose entries are encoded in one context, as the vLLM connector reads
    what its clients stored, takes that context's).
    """

    chunk_tokens: int
    settings: BlendSettings
    blend_kl: float
    turbo_kl: float
    time_share: float
    prompts: int
    bound_met: bool
    by_context: tuple[BlendSettings, ...] = ()
    blend_f1: float = 0.0
    turbo_f1: float = 0.0
    cost: float = 0.0  # the share of the prompt's tokens blend computes

    def settings_in(self, context: str | None) -> BlendSettings:
        """The settings for entries encoded in ``context`` (None: the chosen ones)."""
        if context is None or context == self.settings.chunk_context:
            return self.settings
        found = [s for s in self.by_context if s.chunk_context == context]
        return found[0] if found else replace(self.settings, chunk_context=context)

    @property
    def kl_ratio(self) -> float:
        """Blend's KL as a multiple of turbo's on the sample."""
        return self.blend_kl / self.turbo_kl if self.turbo_kl > 0 else math.inf

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["settings"] = self.settings.as_json()
        out["by_context"] = [s.as_json() for s in self.by_context]
        return out

    @classmethod
    def from_json(cls, raw: Any) -> CalibratedChoice:
        if not isinstance(raw, Mapping):
            raise CalibrationError("a choice must be an object")
        try:
            choice = cls(
                chunk_tokens=_number(raw["chunk_tokens"], int, 1),
                settings=BlendSettings.from_json(raw["settings"]),
                blend_kl=_number(raw["blend_kl"], float, 0.0),
                turbo_kl=_number(raw["turbo_kl"], float, 0.0),
                time_share=_number(raw["time_share"], float, 0.0),
                prompts=_number(raw["prompts"], int, 1),
                bound_met=bool(raw["bound_met"]),
                by_context=tuple(BlendSettings.from_json(s) for s in _list(raw, "by_context")),
                blend_f1=_number(raw.get("blend_f1", 0.0), float, 0.0),
                turbo_f1=_number(raw.get("turbo_f1", 0.0), float, 0.0),
                cost=_number(raw.get("cost", 0.0), float, 0.0),
            )
        except KeyError as exc:
            raise CalibrationError(f"a choice lacks {exc}") from exc
        return choice


@dataclass(frozen=True)
class Calibration:
    """One model's calibrated blend settings: a choice per chunk length measured.

    Examples:
        >>> a = CalibratedChoice(64, BlendSettings("sink", "query", 0.3), 0.1, 0.3, 0.4, 8, True)
        >>> b = CalibratedChoice(600, BlendSettings(), 0.05, 0.2, 0.3, 8, True)
        >>> cal = Calibration("abc", "m", (a, b), bound=0.5)
        >>> cal.choice_for(80).chunk_tokens, cal.choice_for(300).chunk_tokens
        (64, 600)
        >>> Calibration.from_json(cal.as_json()) == cal
        True
    """

    identity: str
    model: str
    choices: tuple[CalibratedChoice, ...]
    bound: float = 0.5
    details: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @property
    def record_name(self) -> str:
        return record_name(self.identity)

    def choice_for(self, chunk_tokens: float) -> CalibratedChoice:
        """The choice measured on chunks nearest ``chunk_tokens`` in length (log scale).

        Raises:
            CalibrationError: the calibration holds no choice.
        """
        if not self.choices:
            raise CalibrationError("the calibration holds no choice")
        length = max(1.0, float(chunk_tokens))
        return min(self.choices, key=lambda c: abs(math.log(c.chunk_tokens / length)))

    def with_choice(self, choice: CalibratedChoice) -> Calibration:
        """This calibration with ``choice`` replacing one measured on chunks within a
        factor 1.5 of its length (a new calibration of that shape), else added."""
        kept = [
            c
            for c in self.choices
            if abs(math.log(c.chunk_tokens / choice.chunk_tokens)) > math.log(1.5)
        ]
        ordered = sorted([*kept, choice], key=lambda c: c.chunk_tokens)
        return replace(self, choices=tuple(ordered))

    def as_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "identity": self.identity,
            "model": self.model,
            "bound": self.bound,
            "choices": [c.as_json() for c in self.choices],
            "details": dict(self.details),
        }

    def dumps(self) -> str:
        return json.dumps(self.as_json(), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, raw: Any) -> Calibration:
        """A calibration from its record's JSON.

        Raises:
            CalibrationError: malformed (a damaged or foreign record).
        """
        if not isinstance(raw, Mapping) or raw.get("format") != FORMAT:
            raise CalibrationError(f"not a calibration record of format {FORMAT}")
        identity, model = raw.get("identity"), raw.get("model")
        if not isinstance(identity, str) or not isinstance(model, str):
            raise CalibrationError("a calibration names its identity and model")
        choices = raw.get("choices")
        if not isinstance(choices, list) or not 0 < len(choices) <= 64:
            raise CalibrationError("a calibration holds 1 to 64 choices")
        details = raw.get("details", {})
        return cls(
            identity,
            model,
            tuple(CalibratedChoice.from_json(c) for c in choices),
            _number(raw.get("bound", 0.5), float, 0.0),
            details if isinstance(details, Mapping) else {},
        )

    @classmethod
    def loads(cls, text: str) -> Calibration:
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise CalibrationError(f"a calibration record is not JSON: {exc}") from exc
        return cls.from_json(raw)


def record_name(identity: str) -> str:
    """The store record a model's calibration is kept under."""
    return RECORD_PREFIX + identity


def median_chunk_tokens(prompt: TokenizedPrompt) -> float:
    """The median length of the prompt's chunks (0: it has none)."""
    lengths = sorted(p.ids.numel() for p in prompt.chunk_pieces)
    if not lengths:
        return 0.0
    mid = len(lengths) // 2
    return float(lengths[mid] if len(lengths) % 2 else (lengths[mid - 1] + lengths[mid]) / 2)


@cache
def bundled_calibrations() -> dict[str, Calibration]:
    """The calibrations shipped for the bundled models, by identity."""
    text = resources.files("kvrag_integrations").joinpath("data/calibrations.json").read_text()
    return {c["identity"]: Calibration.from_json(c) for c in json.loads(text)}


class Calibrations:
    """The calibration one engine uses: its store's record for the model, else the
    bundled one, else none (``CacheBlend``'s defaults, said once in the log).

    The store's record is read again at most every minute (a calibration made by
    another process is taken up without a restart).

    Args:
        identity: the model's checkpoint identity (``checkpoint_identity``).
        model: the model's name (for the log).
        shelf: the store's records (``store.records.records_for``), or None.
    """

    def __init__(self, identity: str, model: str, shelf: Any = None) -> None:
        self.identity = identity
        self.model = model
        self.shelf = shelf
        self._lock = threading.Lock()
        self._read_at = -math.inf
        self._stored: Calibration | None = None
        self._said = False

    def current(self, *, read: bool = True) -> Calibration | None:
        """The calibration in use (None: the model was never calibrated); ``read``
        False never reads the store (the last record read, else the bundled one:
        for a caller that must not wait on it, vLLM's scheduler step)."""
        with self._lock:
            now = time.monotonic()
            if read and self.shelf is not None and now - self._read_at >= REREAD_S:
                self._read_at = now
                self._stored = self._read()
            found = self._stored or bundled_calibrations().get(self.identity)
            if found is None and not self._said:
                self._said = True
                logger.warning(
                    "%s has no blend calibration: blend uses CacheBlend's defaults; "
                    "`kvrag calibrate --model %s --store <your store>` measures the "
                    "settings that keep its answers closest to full prefill",
                    self.model,
                    self.model,
                )
            return found

    def settings_for(
        self, chunk_tokens: float, context: str | None = None, *, read: bool = True
    ) -> BlendSettings | None:
        """The calibrated settings for chunks of about ``chunk_tokens`` tokens (None:
        none), for entries encoded in ``context`` (None: whichever context was best);
        ``read`` as ``current``'s."""
        calibration = self.current(read=read)
        if calibration is None or chunk_tokens <= 0:
            return None
        return calibration.choice_for(chunk_tokens).settings_in(context)

    def contexts(self) -> tuple[str, ...]:
        """The encoding contexts the calibrated settings read."""
        calibration = self.current()
        if calibration is None:
            return ()
        return tuple(dict.fromkeys(c.settings.chunk_context for c in calibration.choices))

    def save(self, calibration: Calibration) -> None:
        """Record ``calibration`` in the store (every process reads it within a minute).

        Raises:
            CalibrationError: no store to record it in, or another model's calibration.
            StoreWriteError: the store refused the write.
        """
        if self.shelf is None:
            raise CalibrationError("this engine's store keeps no records")
        if calibration.identity != self.identity:
            raise CalibrationError("the calibration is another model's")
        self.shelf.put(calibration.record_name, calibration.dumps())
        with self._lock:
            self._stored, self._read_at = calibration, time.monotonic()

    def _read(self) -> Calibration | None:
        text = self.shelf.get(record_name(self.identity))
        if text is None:
            return None
        try:
            calibration = Calibration.loads(text)
        except CalibrationError as exc:
            logger.warning("the store's calibration of %s is unusable (%s)", self.model, exc)
            return None
        return calibration if calibration.identity == self.identity else None


def _list(raw: Mapping[str, Any], name: str) -> list[Any]:
    value = raw.get(name, [])
    if not isinstance(value, list) or len(value) > 16:
        raise CalibrationError(f"{name} must be a list of at most 16 items")
    return value


def _number(value: Any, kind: type, low: float) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CalibrationError(f"expected a number, got {value!r}")
    if not math.isfinite(value) or value < low:
        raise CalibrationError(f"expected a finite number >= {low}, got {value!r}")
    if kind is int and value != int(value):
        raise CalibrationError(f"expected an integer, got {value!r}")
    return kind(value)


__all__ = [
    "BlendSettings",
    "CalibratedChoice",
    "Calibration",
    "Calibrations",
    "bundled_calibrations",
    "median_chunk_tokens",
    "record_name",
]
