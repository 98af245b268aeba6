"""B2's BiG-FL tuning chooses κ only among runs whose lower level stayed strongly convex
(ALGORITHMS.md §0.1 C2 c) and counts rounds whose implicit solve stopped above its tolerance
(C2 d). The runs are replaced by curves of the recorded shape; the choice is the code under test."""

from __future__ import annotations

import numpy as np

from graphfl.bench import multicenter as mc
from graphfl.bench import multicenter_bigfl as mb


def _run(val: float, curvature: list[float | None], unconverged: tuple[int, ...] = ()) -> dict:
    rows = [{"round": 0, "test_loss": 0.4}]
    for r, c in enumerate(curvature, start=1):
        server = {"phi_minus_identity": 0.1 * r, "implicit_converged": int(r not in unconverged)}
        if c is not None:
            server["ll_min_curvature"] = c
        rows.append({"round": r, "test_loss": val, "server": server})
    return {"curve": rows, "aggregate_seconds": [], "wall_seconds": 0.0, "local_test_loss": val,
            "phi": np.eye(2)}


def _fake_b2(calls: list):
    """κ = 0.1 has the best validation MSE but loses strong convexity in round 3; κ = 1 is admissible
    but worse than κ = 0.3."""

    def fake_run_any(method, task, nodes, rounds, seed, settings, train, params=None, hook=None, hook_key=""):
        calls.append((method, dict(settings)))
        kappa = settings.get("bigfl.kappa", 0.3)
        step = 0.01 * abs(settings["lr"] - 1.0)
        if method != "bigfl":
            return _run(0.3, [None, None, None])
        if kappa == 0.1:
            return _run(0.20 + step, [0.04, None, -0.07, -0.07])
        return _run((0.25 if kappa == 0.3 else 0.28) + step, [0.2, None, 0.2, 0.2], unconverged=(2,))

    return fake_run_any


def test_inadmissible_reason_names_round_and_curvature():
    assert mc.bigfl_inadmissible(_run(0.2, [0.1, None, 0.05])) is None
    why = mc.bigfl_inadmissible(_run(0.2, [0.1, None, -0.0712, -0.5]))
    assert why == "excluded: LL not strongly convex at round 3 (min curvature -0.0712)"
    # a failed block factorisation in a round counts too
    run = _run(0.2, [0.1, None])
    run["curve"][2]["server"]["ll_strongly_convex"] = 0
    assert mc.bigfl_inadmissible(run) == "excluded: LL not strongly convex at round 2 (min curvature –)"
    assert mc.implicit_unconverged_rounds(_run(0.2, [0.1, 0.1, 0.1], unconverged=(1, 3))) == [1, 3]


def test_b2_tuning_excludes_a_kappa_whose_lower_level_lost_strong_convexity(monkeypatch):
    calls: list = []
    monkeypatch.setattr(mc, "run_any", _fake_b2(calls))
    form = mc.Form(**{**mc.QUICK.__dict__, "bigfl_lambdas": (0.1, 1.0), "bigfl_alphas": (0.02,)})
    assert set(form.bigfl_kappas) == {1.0, 0.3, 0.1}  # the default grid reaches above the curvature deficit
    out = mc.tune_generator("smooth", form, 0)
    b = out["bigfl"]
    # κ = 0.1 validates best, but its LL was not strongly convex: not chosen, and the result says why
    assert b["kappa"] == 0.3 and out["settings"]["bigfl"]["bigfl.kappa"] == 0.3
    assert set(b["kappa_step_grid_val_mse"]) == {"kappa=1", "kappa=0.3"}
    reasons = b["kappa_excluded"]["kappa=0.1"]
    assert reasons["lr=1"] == "excluded: LL not strongly convex at round 3 (min curvature -0.07)"
    assert b["implicit_unconverged_rounds"] == [2]
    # the λ × α grid runs at the admissible κ only
    lam_cells = [s for m, s in calls if m == "bigfl" and s.get("bigfl.lam") == 1.0]
    assert lam_cells and all(s["bigfl.kappa"] == 0.3 for s in lam_cells)


def test_b2_tuning_excludes_inadmissible_lambda_alpha_cells(monkeypatch):
    def fake_run_any(method, task, nodes, rounds, seed, settings, train, params=None, hook=None, hook_key=""):
        if settings.get("bigfl.lam") == 1.0:  # the best score, but not strongly convex
            return _run(0.1, [0.2, -0.01])
        return _run(0.25, [0.2, 0.2])

    monkeypatch.setattr(mc, "run_any", fake_run_any)
    form = mc.Form(**{**mc.QUICK.__dict__, "bigfl_lambdas": (0.1, 1.0), "bigfl_alphas": (0.02, 0.05)})
    grid = mc.tune_bigfl_grid("t+val", 2, 0, 1.0, form, _run(0.25, [0.2, 0.2]), kappa=0.3)
    assert grid["lam"] == 0.1
    assert grid["excluded"]["lam=1, alpha=0.02"].startswith("excluded: LL not strongly convex at round 2")
    assert grid["lam_alpha_grid_val_mse"]["lam=1"]["alpha=0.02"] is None


def test_b2_tuning_fails_clearly_when_no_kappa_is_admissible(monkeypatch):
    monkeypatch.setattr(mc, "run_any", lambda *a, **k: _run(0.2, [-0.1]))
    form = mc.Form(**{**mc.QUICK.__dict__, "bigfl_kappas": (0.3, 0.1)})
    try:
        mc.tune_bigfl_kappas("t+val", 1, 0, form, dict(mc.BIGFL_DEFAULT))
    except RuntimeError as exc:
        assert "no kappa in [0.3, 0.1]" in str(exc) and "extend the kappa grid upwards" in str(exc)
    else:
        raise AssertionError("expected a RuntimeError")


def test_rerun_tuning_skips_inadmissible_cells(tmp_path, monkeypatch):
    def fake(jobs, workers):
        out = []
        for _, _task, rounds, _seed, st, _phi in jobs:
            bad = st["bigfl.kappa"] == 0.1
            val = 0.2 if bad else 0.25 + 0.01 * st["lr"] + (0.02 if st["bigfl.kappa"] == 0.3 else 0.0)
            out.append(_run(val, [-0.2 if bad else 0.1] * rounds))
        return out

    monkeypatch.setattr(mb, "_run_all", fake)
    prev = {"config": {"tune_generators": ["smooth"], "rounds": 3, "tuning_seed": 0}}
    t = mb.tune(prev, mb.RerunForm(lambdas=(0.1,)), tmp_path)
    assert t["settings"]["bigfl.kappa"] == 1.0 and t["settings"]["lr"] == 1.0
    assert t["step_kappa_grid"]["lr=1, kappa=0.1"]["excluded"].startswith("excluded: LL not strongly convex at round 1")
    assert t["step_kappa_grid"]["lr=1, kappa=0.3"]["excluded"] is None


def test_a_non_finite_curvature_is_not_admissible():
    from graphfl.bench.multicenter import bigfl_inadmissible

    for bad in (float("nan"), float("-inf")):
        run = {"curve": [{"round": 1, "server": {"ll_min_curvature": 0.2}},
                         {"round": 2, "server": {"ll_min_curvature": bad}}]}
        assert bigfl_inadmissible(run) is not None and "round 2" in bigfl_inadmissible(run)
    assert bigfl_inadmissible({"curve": [{"round": 1, "server": {"ll_min_curvature": 0.2}}]}) is None


def _lambda_fake(calls: list, bad_lams: tuple[float, ...] = ()):
    """Validation MSE 0.1 + λ (the smaller λ the better, as in B2's full form); a λ in ``bad_lams``
    loses strong convexity in round 2."""

    def fake_run_any(method, task, nodes, rounds, seed, settings, train, params=None, hook=None, hook_key=""):
        lam = settings.get("bigfl.lam", 0.1)
        calls.append(dict(settings))
        return _run(0.1 + lam + 0.01 * settings.get("bigfl.alpha", 0.02), [0.2, -0.01] if lam in bad_lams else [0.2, 0.2])

    return fake_run_any


def test_b2_lambda_winning_its_lower_edge_is_extended_at_the_best_alpha(monkeypatch):
    calls: list = []
    monkeypatch.setattr(mc, "run_any", _lambda_fake(calls))
    form = mc.Form(**{**mc.QUICK.__dict__, "bigfl_lambdas": (0.01, 0.1, 1.0), "bigfl_alphas": (0.005, 0.02)})
    grid = mc.tune_bigfl_grid("t+val", 2, 0, 0.3, form, _run(0.5, [0.2, 0.2]), kappa=0.3)
    ext = grid["lam_extension"]
    # 0.01 wins the grid at its lower edge: 0.001, then 0.0001, each at α = 0.005 and the tuned κ and step
    assert ext["extended"] == [0.001, 0.0001] and ext["alpha"] == 0.005
    beyond = [s for s in calls if s["bigfl.lam"] < 0.01]
    assert [s["bigfl.lam"] for s in beyond] == [0.001, 0.0001]
    assert all(s["bigfl.alpha"] == 0.005 and s["bigfl.kappa"] == 0.3 and s["lr"] == 0.3 for s in beyond)
    assert grid["lam"] == 0.0001 and grid["alpha"] == 0.005 and ext["at_edge"]
    assert ext["val_mse"]["0.0001"] < ext["val_mse"]["0.001"] < ext["val_mse"]["0.01"]
    assert "λ past its grid's winning edge" in "\n".join(mc._lambda_extension_lines(ext))


def test_b2_lambda_extension_skips_an_inadmissible_lambda_and_keeps_ties(monkeypatch):
    calls: list = []
    monkeypatch.setattr(mc, "run_any", _lambda_fake(calls, bad_lams=(0.0001,)))
    form = mc.Form(**{**mc.QUICK.__dict__, "bigfl_lambdas": (0.01, 0.1, 1.0), "bigfl_alphas": (0.005,)})
    grid = mc.tune_bigfl_grid("t+val", 2, 0, 0.3, form, _run(0.5, [0.2, 0.2]), kappa=0.3)
    assert grid["lam"] == 0.001 and grid["lam_extension"]["val_mse"]["0.0001"] is None
    assert grid["excluded"]["lam=0.0001, alpha=0.005"].startswith("excluded: LL not strongly convex at round 2")
    # an interior winner runs nothing beyond the grid
    calls.clear()
    monkeypatch.setattr(mc, "run_any", lambda *a, **k: _run(0.3 if a[5]["bigfl.lam"] == 0.1 else 0.4, [0.2, 0.2]))
    grid = mc.tune_bigfl_grid("t+val", 2, 0, 0.3, form, _run(0.5, [0.2, 0.2]), kappa=0.3)
    assert grid["lam"] == 0.1 and grid["lam_extension"]["extended"] == []
    # a tie beyond the edge keeps the grid's λ
    monkeypatch.setattr(mc, "run_any", lambda *a, **k: _run(0.25, [0.2, 0.2]))
    grid = mc.tune_bigfl_grid("t+val", 2, 0, 0.3, form, _run(0.5, [0.2, 0.2]), kappa=0.3)
    assert grid["lam"] == 0.01 and grid["lam_extension"]["extended"] == [0.001, 0.0001]


def test_b2_bigfl_step_is_searched_again_at_the_chosen_lambda(monkeypatch):
    """At the default λ 0.1 every step above 0.3 loses strong convexity; at the chosen λ 0.01 step 1
    is admissible and better: the second pass finds it and the settings use it."""
    calls: list = []

    def fake_run_any(method, task, nodes, rounds, seed, settings, train, params=None, hook=None, hook_key=""):
        calls.append(dict(settings))
        lam, lr = settings["bigfl.lam"], settings["lr"]
        if lam == 1.0 or (lam == 0.1 and lr > 0.3) or lr >= 3.0:
            return _run(0.05, [0.2, -0.01])
        return _run(0.1 + lam - 0.02 * lr, [0.2, 0.2])

    monkeypatch.setattr(mc, "run_any", fake_run_any)
    form = mc.Form(**{**mc.QUICK.__dict__, "bigfl_kappas": (0.3,), "bigfl_lambdas": (0.01, 0.1, 1.0),
                      "bigfl_alphas": (0.02,), "bigfl_lambda_extensions": 0, "bigfl_kappa_extensions": 0})
    out = mc.tune_generator("smooth", form, 0, methods=("bigfl",))
    b = out["bigfl"]
    assert b["lr"] == 0.3 and b["lam"] == 0.01  # the first pass, at λ 0.1
    sp = b["step_second_pass"]
    assert sp["ran"] and sp["first_pass_lr"] == 0.3 and sp["lr"] == 1.0
    assert out["settings"]["bigfl"] == {"lr": 1.0, "bigfl.lam": 0.01, "bigfl.alpha": 0.02, "bigfl.kappa": 0.3}
    assert "lr=3" in sp["excluded"]
    second = [c for c in calls if c["bigfl.lam"] == 0.01 and c["lr"] != 0.3]
    assert second and all(c["bigfl.kappa"] == 0.3 and c["bigfl.alpha"] == 0.02 for c in second)
    assert "searched again" in "\n".join(mc._second_pass_lines(sp))


def test_b2_bigfl_second_pass_skipped_at_the_default_lambda_and_alpha():
    chosen = {"lr": 0.3, **mc.BIGFL_DEFAULT, "bigfl.kappa": 0.3}
    sp = mc.retune_bigfl_step("t+val", 2, 0, mc.QUICK, chosen)  # no run: the first pass searched here
    assert sp == {"ran": False, "lr": 0.3, "grid": {}, "excluded": {}}
    assert mc._second_pass_lines(sp) == []


def test_b2_lambda_extension_skipped_when_the_default_run_outside_the_grid_wins(monkeypatch):
    calls: list = []
    monkeypatch.setattr(mc, "run_any", _lambda_fake(calls))  # 0.1 + λ + 0.01 α: every grid cell ≥ 0.1105
    form = mc.Form(**{**mc.QUICK.__dict__, "bigfl_lambdas": (0.01, 1.0), "bigfl_alphas": (0.05,)})
    grid = mc.tune_bigfl_grid("t+val", 2, 0, 0.3, form, _run(0.1, [0.2, 0.2]), kappa=0.3)
    assert (grid["lam"], grid["alpha"]) == (0.1, 0.02) and grid["lam_extension"] is None
    assert all(c["bigfl.lam"] in (0.01, 1.0) for c in calls)  # nothing run beyond the grid
    assert mc._second_pass_note({"lr": 0.3, "step_second_pass": {"ran": True, "lr": 1.0}}) == " (second pass: 1)"


def test_b2_bigfl_kappa_is_searched_again_at_the_chosen_step_and_lambda(monkeypatch):
    """At the default λ κ 0.3 wins; at the chosen λ 0.01 and step 1, κ 0.1 is better and
    admissible, and κ 0.033 beyond the grid's edge loses strong convexity: the κ pass picks 0.1,
    the settings use it, the excluded κ is named."""
    calls: list = []

    def fake_run_any(method, task, nodes, rounds, seed, settings, train, params=None, hook=None, hook_key=""):
        calls.append(dict(settings))
        lam, lr, kappa = settings["bigfl.lam"], settings["lr"], settings.get("bigfl.kappa", 0.3)
        if lam == 1.0 or (lam == 0.1 and lr > 0.3) or lr >= 3.0 or kappa < 0.05:
            return _run(0.01, [0.2, -0.01])
        if lam == 0.01 and lr == 1.0:
            return _run({0.1: 0.05, 0.3: 0.08, 1.0: 0.09}[kappa], [0.2, 0.2])
        return _run(0.1 + lam - 0.02 * lr + (0 if kappa == 0.3 else 0.01), [0.2, 0.2])

    monkeypatch.setattr(mc, "run_any", fake_run_any)
    form = mc.Form(**{**mc.QUICK.__dict__, "bigfl_kappas": (0.3, 1.0, 0.1), "bigfl_lambdas": (0.01, 0.1, 1.0),
                      "bigfl_alphas": (0.02,), "bigfl_lambda_extensions": 0})
    out = mc.tune_generator("smooth", form, 0, methods=("bigfl",))
    b = out["bigfl"]
    assert b["kappa"] == 0.3 and b["step_second_pass"]["lr"] == 1.0  # first pass and step pass as before
    kp = b["kappa_second_pass"]
    assert kp["ran"] and kp["first_pass_kappa"] == 0.3 and kp["kappa"] == 0.1
    assert kp["extended"] == [0.0333333] and "kappa=0.0333333" in kp["excluded"]
    assert kp["val_mse"]["0.0333333"] is None and not kp["at_edge"]
    assert out["settings"]["bigfl"] == {"lr": 1.0, "bigfl.lam": 0.01, "bigfl.alpha": 0.02, "bigfl.kappa": 0.1}
    at_chosen = [c for c in calls if c["bigfl.lam"] == 0.01 and c["lr"] == 1.0]
    assert {c["bigfl.kappa"] for c in at_chosen} == {0.1, 0.3, 1.0, 0.0333333}
    text = "\n".join(mc._kappa_pass_lines(kp))
    assert "chosen κ 0.1" in text and "not searched again" in text


def test_b2_bigfl_kappa_pass_keeps_kappa_on_a_tie_and_skips_without_a_step_pass(monkeypatch):
    monkeypatch.setattr(mc, "run_any", lambda *a, **k: _run(0.1, [0.2, 0.2]))
    chosen = {"lr": 1.0, "bigfl.lam": 0.01, "bigfl.alpha": 0.02, "bigfl.kappa": 0.3}
    kp = mc.retune_bigfl_kappa("t+val", 2, 0, mc.QUICK, chosen, {"ran": True})
    assert kp["kappa"] == 0.3 and kp["ran"]  # every κ ties: the chosen one stays
    monkeypatch.setattr(mc, "run_any", lambda *a, **k: _run(0.1 - (1e-12 if a[5]["bigfl.kappa"] == 1.0 else 0),
                                                            [0.2, 0.2]))
    assert mc.retune_bigfl_kappa("t+val", 2, 0, mc.QUICK, chosen, {"ran": True})["kappa"] == 0.3  # float noise
    assert mc._kappa_pass_note({"kappa": 0.3, "kappa_second_pass": {"ran": True, "kappa": 0.1}}) == \
        ", final κ = 0.1 (κ pass)"
    assert mc.retune_bigfl_kappa("t+val", 2, 0, mc.QUICK, chosen, {"ran": False}) == {
        "ran": False, "kappa": 0.3, "val_mse": {}, "extended": [], "excluded": {}}
