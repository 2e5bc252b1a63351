"""Blend's calibrated settings: the record, where it is kept, and how engines read it.

Records are untrusted bytes from a shared store: any JSON is a ``Calibration`` or a
``CalibrationError``, never another exception (Hypothesis); a record signed with
another secret, a FIFO or an oversized file in its place is not read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrag_integrations import KVRAGEngine
from kvrag_integrations.bench.rows import request_options
from kvrag_integrations.engine.blend_settings import (
    BlendSettings,
    CalibratedChoice,
    Calibration,
    Calibrations,
    bundled_calibrations,
    record_name,
)
from kvrag_integrations.errors import CalibrationError
from kvrag_integrations.store import DiskKVStore, MemoryKVStore
from kvrag_integrations.store.records import MAX_RECORD_BYTES, DiskRecords, records_for

SHORT = CalibratedChoice(64, BlendSettings("sink", "query", 0.3), 0.05, 0.2, 0.45, 8, True)
LONG = CalibratedChoice(600, BlendSettings("alone", "deviation", 0.15, 4), 0.08, 0.2, 0.3, 8, True)


def calibration(identity: str = "abc") -> Calibration:
    return Calibration(identity, "tiny", (SHORT, LONG), bound=0.5)


def test_a_record_round_trips_and_picks_the_nearest_chunk_length() -> None:
    cal = Calibration.loads(calibration().dumps())
    assert cal == calibration()
    assert cal.choice_for(40).settings == SHORT.settings
    assert cal.choice_for(150).settings == SHORT.settings  # nearer 64 than 600 in log scale
    assert cal.choice_for(250).settings == LONG.settings
    assert cal.choice_for(5000).settings == LONG.settings


def test_a_new_choice_replaces_one_of_about_its_chunk_length() -> None:
    again = CalibratedChoice(80, BlendSettings("sink", "query", 0.2), 0.04, 0.2, 0.4, 8, True)
    cal = calibration().with_choice(again)
    assert [c.chunk_tokens for c in cal.choices] == [80, 600]
    other = CalibratedChoice(200, BlendSettings(), 0.04, 0.2, 0.4, 8, True)
    assert [c.chunk_tokens for c in cal.with_choice(other).choices] == [80, 200, 600]


@pytest.mark.parametrize(
    "edit",
    [
        lambda r: r.update(format=2),
        lambda r: r.pop("identity"),
        lambda r: r.update(choices=[]),
        lambda r: r["choices"][0]["settings"].update(recompute_ratio=1.5),
        lambda r: r["choices"][0]["settings"].update(chunk_context="elsewhere"),
        lambda r: r["choices"][0]["settings"].update(extra=1),
        lambda r: r["choices"][0].update(blend_kl=float("nan")),
        lambda r: r["choices"][0].update(chunk_tokens=0),
        lambda r: r["choices"][0].update(prompts=True),
    ],
)
def test_a_malformed_record_is_a_calibration_error(edit) -> None:
    raw = calibration().as_json()
    edit(raw)
    with pytest.raises(CalibrationError):
        Calibration.from_json(raw)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.one_of(json_values, st.builds(lambda r: r, st.just(calibration().as_json()))))
def test_any_json_is_a_calibration_or_a_calibration_error(raw) -> None:
    with contextlib.suppress(CalibrationError):  # (anything else fails the test)
        Calibration.from_json(raw)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_any_text_is_a_calibration_or_a_calibration_error(text) -> None:
    with contextlib.suppress(CalibrationError):
        Calibration.loads(text)


def test_records_are_signed_with_the_store_secret(tmp_path) -> None:
    signed = DiskRecords(tmp_path, b"secret")
    signed.put("calibration:abc", "hello")
    assert signed.get("calibration:abc") == "hello"
    assert DiskRecords(tmp_path, b"other").get("calibration:abc") is None  # foreign signature
    assert DiskRecords(tmp_path, None).get("calibration:abc") == "hello"  # no secret: as is
    DiskRecords(tmp_path, None).put("calibration:abc", "forged")  # unsigned
    assert signed.get("calibration:abc") is None


def test_a_record_that_is_not_a_small_regular_file_is_not_read(tmp_path) -> None:
    shelf = DiskRecords(tmp_path)
    shelf.folder.mkdir()
    os.mkfifo(shelf.folder / "calibration:fifo.json")  # would block a plain open
    assert shelf.get("calibration:fifo") is None
    (shelf.folder / "calibration:big.json").write_bytes(b" " * (MAX_RECORD_BYTES + 1))
    assert shelf.get("calibration:big") is None
    (shelf.folder / "calibration:bad.json").write_bytes(b"{not json")
    assert shelf.get("calibration:bad") is None
    with pytest.raises(ValueError):
        shelf.get("../escape")


def test_the_store_record_is_read_before_the_bundled_one_and_the_default(tmp_path) -> None:
    store = DiskKVStore(tmp_path)
    reader = Calibrations("abc", "tiny", records_for(store))
    assert reader.current() is None
    reader.save(calibration())
    # Another reader on the same store (another engine, a restart) finds it.
    assert (
        Calibrations("abc", "tiny", records_for(DiskKVStore(tmp_path))).current() == calibration()
    )
    with pytest.raises(CalibrationError):
        reader.save(calibration("someone-else"))


def test_a_calibration_survives_a_restart_and_is_read_by_another_process(tmp_path) -> None:
    Calibrations("abc", "tiny", records_for(DiskKVStore(tmp_path))).save(calibration())
    code = (
        "import sys; from kvrag_integrations.store import DiskKVStore;"
        "from kvrag_integrations.store.records import records_for;"
        "from kvrag_integrations.engine.blend_settings import Calibrations;"
        "c = Calibrations('abc', 'tiny', records_for(DiskKVStore(sys.argv[1]))).current();"
        "print(c.choice_for(64).settings.label)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == SHORT.settings.label


def test_an_uncalibrated_model_says_so_once_with_the_command(caplog) -> None:
    reader = Calibrations("never", "tiny-model", records_for(MemoryKVStore()))
    with caplog.at_level(logging.WARNING):
        assert reader.current() is None
        assert reader.current() is None
    said = [r.getMessage() for r in caplog.records if "calibrat" in r.getMessage()]
    assert len(said) == 1 and "kvrag calibrate --model tiny-model" in said[0]


def test_the_bundled_calibrations_parse() -> None:
    for identity, cal in bundled_calibrations().items():
        assert cal.identity == identity
        assert all(c.bound_met for c in cal.choices)


def test_an_engine_uses_its_calibration_for_blend(engine: KVRAGEngine) -> None:
    store = MemoryKVStore()
    eng = KVRAGEngine(engine.loaded, store=store, on_miss="encode", cache_precision="model")
    identity = eng.calibrations.identity
    records_for(store).put(record_name(identity), calibration(identity).dumps())
    eng.calibrations._read_at = float("-inf")  # (re-read now, not in a minute)
    chunks = ["Alpha beta gamma delta. " * 3, "Epsilon zeta eta theta. " * 3]
    result = eng.generate(question="Which?", chunks=chunks, strategy="blend", max_new_tokens=1)
    assert result.strategy == "blend"
    # The calibrated context (sink, for these short chunks) was read, kept apart from
    # the engine's own entries; turbo still reads the engine's.
    sink = eng.caches.fingerprint_for("sink")
    stored = {info.fingerprint for info in store.entries()}
    assert sink in stored
    eng.encode_chunks(["Iota kappa lambda mu. " * 3], show_progress=False)
    both = [i for i in store.entries() if i.fingerprint in (sink, eng.fingerprint)]
    assert {i.fingerprint for i in both} == {sink, eng.fingerprint}
    # A call's own options win over the calibrated ones.
    request = eng.prepare(eng_options(recompute_ratio=0.0), question="Which?", chunks=chunks)
    assert request.strategy.recompute_ratio == 0.0
    assert request.strategy.chunk_context == "sink"
    # A benchmark row that names options runs those over CacheBlend's own defaults,
    # not the calibrated ones (its label says what it ran).
    row = request_options("blend", {"recompute_ratio": 0.0})
    request = eng.prepare(eng_options(**row), question="Which?", chunks=chunks)
    assert request.strategy.chunk_context in (None, eng.prompts.context)
    assert (request.strategy.selection, request.strategy.recompute_first) == ("auto", 0)
    assert request_options("blend", {}) == {}  # blend by name: as calibrated


def eng_options(**options):
    from kvrag_integrations.engine.request import RequestOptions

    return RequestOptions(strategy="blend", strategy_options=options)


def test_settings_json_fields_are_exactly_the_strategy_options() -> None:
    from kvrag_integrations.engine.strategies import CacheBlend

    blend = CacheBlend(**LONG.settings.strategy_options())
    assert (blend.chunk_context, blend.selection, blend.recompute_ratio) == (
        "alone",
        "deviation",
        0.15,
    )
    assert json.loads(json.dumps(LONG.as_json()))["settings"]["recompute_first"] == 4


def test_a_candidate_meets_the_bound_only_with_confidence() -> None:
    """A setting whose mean KL ratio is under the bound but whose 90% interval
    reaches past it (a few outlier prompts) does not meet it; nor one whose answers
    agree with full's no better than turbo's."""
    from kvrag_integrations.bench.metrics import paired_bootstrap
    from kvrag_integrations.calibration.run import Baseline, Measured

    turbo = [0.2, 0.3, 0.25, 0.2, 0.3, 0.25, 0.2, 0.3]
    steady = [0.08, 0.1, 0.09, 0.08, 0.11, 0.1, 0.09, 0.1]  # 0.37x, tight
    spiky = [0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.7]  # 0.37x, one outlier
    baseline = Baseline(sum(turbo) / 8, 0.5, turbo)

    def measured(kls: list[float], f1: float) -> Measured:
        high = paired_bootstrap(kls, turbo)[2]
        return Measured(SHORT.settings, sum(kls) / 8, f1, 0.2, 0.2, kls, high)

    assert measured(steady, 0.7).meets(baseline, 0.5, 0.05)
    assert not measured(spiky, 0.7).meets(baseline, 0.5, 0.05)
    assert not measured(steady, 0.52).meets(baseline, 0.5, 0.05)
