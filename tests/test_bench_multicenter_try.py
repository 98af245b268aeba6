"""B2's tuning drops a setting that fails, but never one refused for its configuration.

A checkpoint written under another configuration (or any ConfigError) used to be counted as a
failed tuning cell, so the tuning silently lost that setting; it must stop the bench instead.
"""

from __future__ import annotations

import pytest

from graphfl.bench import multicenter as mc
from graphfl.server.checkpoint import CheckpointError


def test_a_diverging_setting_is_dropped_but_a_configuration_error_stops_the_tuning(monkeypatch):
    def diverges(*_a, **_k):
        raise RuntimeError("round 9: every client returned NaN")

    monkeypatch.setattr(mc, "run_any", diverges)
    assert mc._try("bigfl lr 3") is None

    def refused(*_a, **_k):
        raise CheckpointError("checkpoint: cannot resume with another configuration (data.client-samples: ...)")

    monkeypatch.setattr(mc, "run_any", refused)
    with pytest.raises(CheckpointError, match="another configuration"):
        mc._try("bigfl lr 0.3")
