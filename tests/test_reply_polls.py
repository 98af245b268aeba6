"""The ServerApp's waits between reply pulls (server/reply_polls.py)."""

from __future__ import annotations

import math

import pytest

from graphfl.server.reply_polls import ReplyPollClock, ReplyPolls, poll_replies


class FakeTime:
    """A clock that only moves when the code under test sleeps or a pull takes time."""

    def __init__(self) -> None:
        self.t = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.t += seconds


def simulate(polls: ReplyPolls, arrivals: list[float], pull_cost: float = 0.0, timeout: float = 1e9
             ) -> tuple[int, list[float], list[float]]:
    """:func:`poll_replies` on replies arriving at ``arrivals`` (seconds after the start), each pull
    taking ``pull_cost`` s (a reply is seen when it arrived before the pull's answer); returns the
    number of pulls, each reply's delay (seen − arrived) and the times the wait restarted (the
    start and every pull that brought a reply)."""
    fake = FakeTime()
    pending, delays, restarts = sorted(arrivals), [], [0.0]

    def pull(budget: float) -> int:
        assert budget > 0
        fake.t += pull_cost
        seen = [a for a in pending if a <= fake.t]
        pending[:] = [a for a in pending if a > fake.t]
        delays.extend(fake.t - a for a in seen)
        if seen:
            restarts.append(fake.t)
        return len(seen)

    made = poll_replies(pull, lambda: bool(pending), polls, timeout, clock=fake.clock, sleep=fake.sleep)
    return made, delays, restarts


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


def test_a_slow_pull_adds_at_most_its_own_duration_to_the_bound() -> None:
    arrivals, cost = [4.0, 9.6, 9.8, 10.0, 10.2], 0.3
    polls = ReplyPolls()
    _, delays, restarts = simulate(polls, arrivals, pull_cost=cost)
    for a, d in zip(arrivals, delays):
        since = max(r for r in restarts if r <= a)
        assert d <= min(polls.longest, max(polls.shortest, polls.fraction * (a - since))) + cost + 1e-9


def test_no_wait_runs_past_the_deadline_and_pulls_stop_there() -> None:
    fake = FakeTime()
    budgets: list[float] = []

    def pull(budget: float) -> int:
        budgets.append(budget)
        return 0

    made = poll_replies(pull, lambda: True, ReplyPolls(), 3.0, clock=fake.clock, sleep=fake.sleep)
    assert fake.t == pytest.approx(3.0) and made == len(budgets) >= 2
    assert all(b > 0 for b in budgets) and budgets == sorted(budgets, reverse=True)


def test_nothing_outstanding_makes_no_pull() -> None:
    fake = FakeTime()
    assert poll_replies(lambda b: 1, lambda: False, ReplyPolls(), 5.0, clock=fake.clock, sleep=fake.sleep) == 0
    assert fake.sleeps == []


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
