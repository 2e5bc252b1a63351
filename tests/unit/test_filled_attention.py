"""Attention over a static cache's filled slots (engine/modeling/filled_attention.py):
the torch fallback and the split-KV Triton kernel against SDPA over exactly the
keys each row may see, on several lengths, head counts and grouped-query ratios.

The kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, CPU
tensors) in one subprocess (tests/unit/triton_cases.py): Triton reads the
variable as it defines its own functions, and torch imports Triton early. It is
skipped where Triton is not installed. The interpreter multiplies bfloat16
operands wrongly, so there the kernel's dots take float32 operands (the same
values): the bfloat16 loads and stores and the float32 accumulation are what
those cases check; the bfloat16 dot itself runs on the GPU only
(scripts/gpu_check_53.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvrag_integrations.engine.modeling import filled_attention as fa
from tests.unit.triton_cases import CASES, DTYPES, SHAPES, case, case_id, reference

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("shape", SHAPES)
def test_the_masked_sdpa_fallback_attends_over_the_filled_slots(shape: tuple) -> None:
    q, k, v, slots = case(shape, torch.float32, poison=False)
    got = fa.masked_sdpa(q, k, v, torch.tensor(slots), q.shape[-1] ** -0.5)
    assert (got.double() - reference(q, k, v, slots)).abs().max() <= 1e-5


def test_the_hook_takes_scattered_rows_and_runs_torch_on_cpu() -> None:
    """Rows need not be consecutive (text between reused chunks): row t sees slots
    up to its own. On CPU the hook runs the fallback unless told otherwise."""
    q, k, v, _ = case((4, 2, 16, 4, 64, 0), torch.float32, poison=False)
    slots = [3, 9, 10, 30]
    assert not fa.kernel_available(q.device)
    got = fa.filled_attention(q, k, v, torch.tensor(slots))
    assert (got.double() - reference(q, k, v, slots)).abs().max() <= 1e-5


@pytest.fixture(scope="module")
def interpreted() -> dict:
    """tests/unit/triton_cases.py's results, run under the interpreter."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.unit.triton_cases"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("shape", "dtype"), CASES)
def test_the_triton_kernel_equals_sdpa_and_reads_only_filled_slots(
    interpreted: dict, shape: tuple, dtype: str
) -> None:
    got = interpreted["kernel"][case_id(shape, dtype)]
    heads, _, dim, rows = shape[:4]
    assert got["supported"] and got["finite"]  # NaN past the last row's slot: never read
    assert got["dtype_shape"] == [str(DTYPES[dtype]), [1, rows, heads, dim]]
    assert got["max_diff"] <= (1e-5 if dtype == "fp32" else 2e-2)


def test_the_static_decode_runs_through_the_kernel(interpreted: dict) -> None:
    """Turbo's tail step and 2 decode steps of the tiny model, the kernel in every
    layer: the tokens of the eager path, the first logits within rounding."""
    got = interpreted["engine"]
    assert got["same_tokens"] and got["first_logits_diff"] <= 1e-4
    assert got["path"].startswith("static, bucket 128")
    assert got["steps"][0] == 1 and got["steps"][-1] > 1  # a decode step and a tail step
    assert got["kernel_calls"] >= 2 * (1 + 2)  # 2 layers: the tail, then the decode steps
