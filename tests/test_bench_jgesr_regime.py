"""`graphfl bench jgesr --form regime`: the full cross noise × missing, tuned per point, and the
quick / full forms left exactly as they were (their points, tuning point and cache keys)."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from graphfl.bench import jgesr as bj
from graphfl.bench.harness import Cell
from graphfl.bench.report import result

TINY = dataclasses.replace(bj.REGIME, nodes=3, rounds=1, local_steps=1, batch_size=8, lr_grid=(0.01, 0.1),
                           noise_levels=(0.0, 1.0, 4.0), missing_rates=(0.0, 0.5))


def test_regime_points_are_the_full_cross_of_the_papers_axes():
    assert bj.REGIME.noise_levels == (0.0, 1.0, 2.0, 4.0) and bj.REGIME.missing_rates == (0.0, 0.2, 0.5)
    expected = [{"noise": c, "missing": r} for c, r in itertools.product((0.0, 1.0, 2.0, 4.0), (0.0, 0.2, 0.5))]
    assert bj.regime_points(bj.REGIME) == expected
    bench = bj.declare_regime(bj.REGIME, 0, "digits-permuted")
    assert list(bench.points) == expected and bench.name == "jgesr-regime" and list(bench.seeds) == [0, 1, 2]
    assert bench.tuning is not None and bench.tuning.at is None          # every point tunes itself
    assert set(bench.pair_list()) == {(m, ref) for m in bj.GRAPH_METHODS for ref in ("Local", "FedAvg")} | {
        ("Local", "FedAvg")}
    # the regime form trains at the quick form's scale, with the quick form's methods and grids
    assert {k: v for k, v in bj.REGIME.__dict__.items() if k not in ("noise_levels", "missing_rates")} == {
        k: v for k, v in bj.QUICK.__dict__.items() if k not in ("noise_levels", "missing_rates")}
    # c = 0 reaches the channel as a noiseless one (sigma = 0), not as a default
    values = bj.run_values("JGESR-PDCA", "digits-permuted", bj.REGIME, 0, 1.0, 0.0, 0.2)
    assert values["channel.noise"] == 0.0 and values["channel.missing"] == 0.2 and values["nodes"] == 12


def test_the_tuning_point_rules():
    assert bj.tuning_point("point", bj.REGIME) is None
    at_noise = bj.tuning_point("noise", bj.REGIME)
    at_ref = bj.tuning_point("reference", bj.REGIME)
    assert at_noise is not None and at_noise({"noise": 4.0, "missing": 0.5}) == {"noise": 4.0, "missing": 0.0}
    assert at_ref is not None and at_ref({"noise": 4.0, "missing": 0.5}) == {"noise": 1.0, "missing": 0.0}
    with pytest.raises(ValueError, match="tune_at"):
        bj.tuning_point("test", bj.REGIME)


@pytest.mark.parametrize("form, points", [
    (bj.QUICK, [{"noise": 1.0, "missing": 0.0}, {"noise": 2.0, "missing": 0.0}, {"noise": 1.0, "missing": 0.3}]),
    (bj.FULL, [{"noise": 1.0, "missing": 0.0}, {"noise": 2.0, "missing": 0.0}] + [
        {"noise": 1.0, "missing": r} for r in (0.1, 0.2, 0.3, 0.5)]),
])
def test_the_quick_and_full_forms_are_unchanged(form, points):
    bench = bj.declare(form, 0, "digits-permuted")
    assert list(bench.points) == points and bench.name == "jgesr" and bench.reference == "FedAvg"
    assert bench.pair_list() == [(m, "FedAvg") for m in form.methods if m != "FedAvg"]
    assert bench.tuning is not None and bench.tuning.at is not None
    assert all(bench.tuning.at(p) == {"noise": 1.0, "missing": 0.0} for p in points)   # one search for all
    cell = Cell((("noise", 2.0), ("missing", 0.0)), "JGESR-PDCA", 1, (("lr", 1.0), ("graph", (1.0, 0.01, 0.1))))
    # the cache key of a run of the existing forms (results already computed must come from the cache)
    assert bench.key is not None and bench.key(cell) == {
        "method": "JGESR-PDCA", "strategy": "jgesr", "task": "digits-permuted", "nodes": 12, "rounds": form.rounds,
        "seed": 1, "engine": "batched", "train.lr": 1.0, "train.local-steps": form.local_steps,
        "train.batch-size": form.batch_size, "train.momentum": 0.0, "data.dirichlet-alpha": 10.0,
        "channel.noise": 2.0, "channel.missing": 0.0, "jgesr.solver": "pdca", "jgesr.log-graph": False,
        "jgesr.lam": 1.0, "jgesr.alpha": 0.01, "jgesr.beta": 0.1}
    # the regime form's run at the same (c, r, seed, params) has the same key: same training scale
    regime = bj.declare_regime(bj.REGIME, 0, "digits-permuted")
    if form is bj.QUICK:
        assert regime.key is not None and regime.key(cell) == bench.key(cell)


def test_forms_are_chosen_by_name(monkeypatch):
    with pytest.raises(ValueError, match="regime"):
        bj.run(form="paper", task="digits")
    seen = []
    monkeypatch.setattr(bj, "run_regime", lambda **kw: seen.append(kw) or {"name": "jgesr-regime"})
    assert bj.run(quick=True, form="regime", task="digits-permuted")["name"] == "jgesr-regime"
    assert seen == [{"seed": 0, "out": None, "task": "digits-permuted"}]


def _fake(calls):
    """Validation prefers lr 0.1 (JGESR) / 0.01 (others) at every point; on test JGESR-PDCA is 2
    points above Local on every seed, JGESR-two-step 2 points below, FedAvg 10 below."""
    offset = {"FedAvg": -0.10, "Local": 0.0, "JGESR-PDCA": 0.02, "JGESR-two-step": -0.02}

    def fake_run_one(method, task, form, seed, lr, noise, missing, graph=None):
        calls.append((method, task, seed, lr, noise, missing, graph))
        jgesr = method.startswith("JGESR")
        if task.endswith("+val"):
            return {"final": 0.9 if lr == (0.1 if jgesr else 0.01) else 0.5}
        out = {"final": 0.8 + 0.01 * seed + offset[method]}
        if jgesr:
            out.update(shrink_ratio=[0.5, 0.1 if noise == 4.0 else 0.9], graph_cv=[0.3, 0.05 if missing else 1.0])
        return out
    return fake_run_one


def test_regime_run_tunes_at_every_point_and_reports_verdicts_and_diagnostics(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(bj, "run_one", _fake(calls))
    doc = bj.run_regime(seed=0, out=tmp_path, task="digits-permuted", form=TINY)
    points = bj.regime_points(TINY)
    val = {(c[4], c[5]) for c in calls if c[1].endswith("+val")}
    assert val == {(p["noise"], p["missing"]) for p in points}                # tuned at each (c, r)
    assert not [c for c in calls if c[1].endswith("+val") and c[2] != 0]       # first seed only
    for p in points:
        assert result(doc, "JGESR-PDCA", **p)["params"]["lr"] == 0.1
        assert result(doc, "FedAvg", **p)["params"]["lr"] == 0.01
        by = {(v["a"], v["b"]): v for v in doc["verdicts"] if v["point"] == p}
        assert by[("JGESR-PDCA", "Local")]["verdict"] == "wins" and by[("JGESR-PDCA", "Local")]["won"] == 3
        assert by[("JGESR-PDCA", "Local")]["mean"] == pytest.approx(0.02)
        assert by[("JGESR-two-step", "Local")]["verdict"] == "loses" and by[("JGESR-two-step", "Local")]["lost"] == 3
        assert by[("JGESR-two-step", "FedAvg")]["verdict"] == "wins"
        d = doc["diagnostics"]["JGESR-PDCA"][f"c={p['noise']:g}, r={p['missing']:g}"]
        assert d["graph_cv"]["last"] == pytest.approx(0.05 if p["missing"] else 1.0)
        assert bool(d["collapse"]) == (p["missing"] > 0 or p["noise"] == 4.0)
    saved = json.loads((tmp_path / "jgesr-regime.json").read_text())
    assert saved["config"]["tune_at"] == "point" and len(saved["config"]["points"]) == 6
    md = (tmp_path / "jgesr-regime.md").read_text()
    assert "+2.00 ± 0.00 (3/0/0): wins" in md and "graph_cv 0.050 < 0.2" in md and "shrink_ratio 0.100 < 0.2" in md
    assert (tmp_path / "jgesr-regime.png").is_file()


def test_verdict_rule():
    def paired(diffs, **kw):
        return {"per_seed": diffs, "mean": sum(diffs) / len(diffs) if diffs else None, "sd": 0.0,
                "first_nonfinite": [], "second_nonfinite": [], "missing": 0, **kw}

    assert bj.verdict(paired([0.02, 0.03, 0.05]), 3)["verdict"] == "wins"
    assert bj.verdict(paired([0.002, 0.003, 0.005]), 3)["verdict"] == "tie"       # inside the 1-point band
    assert bj.verdict(paired([0.05, 0.05, -0.01]), 3)["verdict"] == "tie"         # not on every seed
    lost = bj.verdict(paired([-0.05, -0.02, -0.03]), 3)
    assert lost["verdict"] == "loses" and (lost["won"], lost["tied"], lost["lost"]) == (0, 0, 3)
    assert bj.verdict(paired([0.05, 0.05], first_nonfinite=[2]), 3)["verdict"] == "loses"
    assert bj.verdict(paired([0.05, 0.05], second_nonfinite=[2]), 3)["verdict"] == "not testable"
    assert bj.verdict(paired([0.0, 0.0, 0.0]), 3)["tied"] == 3


class _Declared(Exception):
    pass


def test_the_regime_form_runs_on_planted_groups_unless_a_task_is_given(monkeypatch):
    """`graphfl bench jgesr --form regime` without --task sweeps digits-permuted (the setting whose
    question the form asks); the other forms keep digits; --task wins."""
    import pytest

    from graphfl.bench import jgesr as bj

    seen: list[str] = []
    monkeypatch.setattr(bj, "run_regime", lambda seed, out, task: seen.append(task) or {})
    bj.run(form="regime")
    bj.run(form="regime", task="digits")
    assert seen == ["digits-permuted", "digits"]

    def declare(spec, seed, task):
        seen.append(task)
        raise _Declared

    monkeypatch.setattr(bj, "declare", declare)
    with pytest.raises(_Declared):
        bj.run(quick=True)
    assert seen[-1] == "digits"
