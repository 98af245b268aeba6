"""The ServerApp's waits between reply pulls (server/reply_polls.py)."""

from __future__ import annotations

import math

import pytest

from graphfl.server.reply_polls import ReplyPollClock, ReplyPolls


def simulate(polls: ReplyPolls, arrivals: list[float], pull_cost: float = 0.0
             ) -> tuple[int, list[float], list[float]]:
    """Pull until every reply of ``arrivals`` (seconds after the start) has been seen; returns the
    number of pulls, each reply's delay (seen − arrived) and the times the wait restarted (the
    start and every pull that brought a reply)."""
    t, clock = 0.0, ReplyPollClock(polls, 0.0)
    pending, delays, pulls, restarts = sorted(arrivals), [], 0, [0.0]
    while pending:
        t += pull_cost
        seen = [a for a in pending if a <= t]
        pending = [a for a in pending if a > t]
        delays += [t - a for a in seen]
        pulls += 1
        clock.pulled(t, got_reply=bool(seen))
        if seen:
            restarts.append(t)
        if pending:
            t += clock.next_wait(t)
    return pulls, delays, restarts


def test_wait_follows_the_rule() -> None:
    p = ReplyPolls(shortest=0.05, fraction=0.1, longest=0.5)
    assert p.wait(0.0) == 0.05
    assert p.wait(0.3) == 0.05            # f * 0.3 = 0.03 < shortest
    assert math.isclose(p.wait(2.0), 0.2)
    assert p.wait(100.0) == 0.5
    assert p.wait(-1.0) == 0.05           # a clock that went backwards never gives less than shortest


def test_a_short_round_polls_as_with_a_constant_wait() -> None:
    arrivals = [0.21, 0.23, 0.26, 0.3]
    new = simulate(ReplyPolls(), arrivals)
    constant = simulate(ReplyPolls(shortest=0.05, fraction=1e-9, longest=0.05), arrivals)
    assert new[:2] == constant[:2]


def test_a_long_round_makes_far_fewer_pulls_and_sees_replies_at_most_a_fraction_late() -> None:
    arrivals = [9.6, 9.8, 10.0, 10.2]
    polls = ReplyPolls(shortest=0.05, fraction=0.1, longest=0.5)
    n_new, delays, restarts = simulate(polls, arrivals)
    n_constant, _, _ = simulate(ReplyPolls(shortest=0.05, fraction=1e-9, longest=0.05), arrivals)
    assert n_constant >= 200
    assert n_new <= n_constant / 4
    assert max(delays) > polls.shortest  # the long wait did grow
    # each reply is seen at most max(shortest, fraction x the time waited since the start or the
    # last pull that brought a reply) late, never more than longest
    for a, d in zip(arrivals, delays):
        since = max(r for r in restarts if r <= a)
        assert d <= min(polls.longest, max(polls.shortest, polls.fraction * (a - since))) + 1e-9


def test_a_reply_restarts_the_wait() -> None:
    clock = ReplyPollClock(ReplyPolls(shortest=0.05, fraction=0.1, longest=0.5), 0.0)
    clock.pulled(4.0, got_reply=False)
    assert math.isclose(clock.next_wait(4.0), 0.4)
    clock.pulled(4.0, got_reply=True)
    assert clock.next_wait(4.01) == 0.05


@pytest.mark.parametrize("kwargs, word", [
    ({"shortest": 0.0}, "shortest"), ({"fraction": -0.1}, "fraction"), ({"longest": float("nan")}, "longest"),
    ({"shortest": 1.0, "longest": 0.5}, "longest"), ({"fraction": "0.1"}, "fraction"),
])
def test_bad_settings_are_refused_by_name(kwargs: dict, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        ReplyPolls(**kwargs)
