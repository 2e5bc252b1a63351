"""Blend inside vLLM, its parts that need no vLLM: the attention our proxies compute.

``connector.blend._attention`` is what every recomputed row attends with (the
model's own projections, norms and rotary run in vLLM around it): rows at any
positions over the run's keys, each seeing keys at positions <= its own and
within the layer's window, grouped heads, softcapped scores. Checked against
the textbook formula; ``_mass`` against the softmax weights it sums.
"""

from __future__ import annotations

import pytest
import torch

from kvrag_integrations.vllm.connector.row_attention import rows_attention, rows_mass


def reference(q, k, v, visible, scale, softcap=None):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("rhd,thd->hrt", q.double(), k.double()) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible[None], float("-inf"))
    weights = scores.softmax(-1)
    return torch.einsum("hrt,thd->rhd", weights, v.double()), weights


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("rows", [5, 90])  # 90: cut in two halves, each over its own keys
def test_scattered_rows_attend_as_the_textbook_says(softcap, window, rows) -> None:
    torch.manual_seed(0)
    length = 4 * rows
    keys_at = torch.arange(length)
    rows_at = torch.randperm(length)[:rows].sort()[0]  # scattered positions, as blend's are
    q = torch.randn(rows, 6, 8)  # 6 query heads over 2 K/V heads
    k, v = torch.randn(length, 2, 8), torch.randn(length, 2, 8)
    visible = keys_at[None] <= rows_at[:, None]
    if window:
        visible &= keys_at[None] > rows_at[:, None] - window
    out = rows_attention(q, k, v, visible, 0.3, softcap)
    expected, weights = reference(q, k, v, visible, 0.3, softcap)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    mass = rows_mass(q[-2:], k, visible[-2:], 0.3, softcap)
    torch.testing.assert_close(mass.double(), weights[:, -2:].sum(dim=(0, 1)), atol=1e-5, rtol=1e-5)
