"""picker.coordination.backoff: the reconnect pacing every Redis link uses."""

from __future__ import annotations

import pytest

from picker.coordination.backoff import Backoff


def test_delays_double_up_to_the_cap_each_jittered_within_half() -> None:
    backoff = Backoff(first_s=0.05, max_s=0.4)
    nominal = [0.05, 0.1, 0.2, 0.4, 0.4, 0.4]
    for expected in nominal:
        assert expected / 2 <= backoff.delay() <= expected


def test_jitter_spreads_replicas_that_failed_together() -> None:
    firsts = {Backoff().delay() for _ in range(50)}
    assert len(firsts) > 40


def test_reset_starts_over_from_the_first_delay() -> None:
    backoff = Backoff(first_s=0.1, max_s=2.0)
    for _ in range(6):
        backoff.delay()
    backoff.reset()
    assert backoff.delay() <= 0.1


@pytest.mark.parametrize(("first", "most"), [(0.0, 1.0), (2.0, 1.0), (-1.0, 1.0)])
def test_a_first_delay_out_of_range_is_refused(first: float, most: float) -> None:
    with pytest.raises(ValueError, match="backoff"):
        Backoff(first_s=first, max_s=most)
