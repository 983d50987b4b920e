"""The compute slowdown while a collective runs beside it (issue 30, ``plan.clock.OVERLAP_SLOWDOWN``) against hand
calculations: a prefetched collective either outlasts the slowed compute (the unit waits for the collective) or
finishes inside it (the unit pays the slowdown for as long as the collective ran)."""

from __future__ import annotations

import pytest

from trainfit.plan.clock import OVERLAP_SLOWDOWN, overlapped


def test_the_source_figure():
    # Lee et al. 2025 (arXiv 2507.03114): 18.9% average compute slowdown while overlapped
    assert OVERLAP_SLOWDOWN == 0.189


def test_a_short_collective_beside_long_compute_costs_its_slowdown():
    # collective 10 ms, compute 30 ms, compute 20% slower beside it: the 10 ms of overlap do 10 / 1.2 = 8.333 ms
    # of the compute, the other 21.667 ms run at full speed: the unit takes 31.667 ms, 1.667 ms beyond 30.
    # 5 units: the first collective waits in full (10 ms), the other 4 cost 1.667 ms each
    assert overlapped(0.010, 0.030, 5, slowdown=0.2) == pytest.approx(0.010 + 4 * 0.0016667, rel=1e-4)


def test_a_long_collective_outlasts_the_slowed_compute():
    # collective 10 ms, compute 6 ms: slowed 20% it takes 7.2 ms, still inside the 10 ms: the unit waits 10 - 6 = 4 ms
    assert overlapped(0.010, 0.006, 3, slowdown=0.2) == pytest.approx(0.010 + 2 * 0.004)
    # the boundary: compute 10 / 1.2 = 8.333 ms slowed to exactly 10 ms; both cases give 10 - 8.333 = 1.667 ms
    assert overlapped(0.010, 0.010 / 1.2, 2, slowdown=0.2) == pytest.approx(0.010 + 0.0016667, rel=1e-4)


def test_the_default_is_the_sourced_slowdown():
    # 4 ms collective behind 20 ms compute at 18.9%: 4 x 0.189 / 1.189 = 0.6358 ms per hidden unit
    assert overlapped(0.004, 0.020, 3) == pytest.approx(0.004 + 2 * 0.00063583, rel=1e-4)
    assert overlapped(0.004, 0.020, 3, slowdown=0.0) == pytest.approx(0.004)
    assert overlapped(0.004, 0.020, 0) == 0.0
