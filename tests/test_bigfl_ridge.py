"""BiG-FL's LL ridge ``(κ/2)‖θ_i − c_i‖²`` (``bigfl.ridge``): the proximal centre ``c_i = θ_i^t``
keeps the LL strongly convex without pulling the clients' models to the zero model, which the
paper's ``κ‖θ_i‖²`` does on B2's 1/60-scaled data for every κ above the curvature deficit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphfl.common.config import ConfigError, parse_run_config
from graphfl.strategies import bigfl as bg
from graphfl.strategies import bigfl_math as bm


@pytest.fixture()
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def test_ridge_gradient_with_a_centre_matches_autograd(float64):
    rng = np.random.default_rng(0)
    d = 4
    theta, m, anchor = (torch.tensor(rng.standard_normal(d)) for _ in range(3))
    phi = torch.eye(d) + 0.3 * torch.tensor(rng.standard_normal((d, d)))
    th = theta.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(bm.ll_reg_loss(th, m, phi, 0.25, 0.7, 0.3, anchor), th)
    got = bm.ll_reg_grad(theta, m, phi, 0.25, 0.7, 0.3, anchor)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # the centre moves only the ridge: at θ = c the ridge is 0 and its gradient vanishes
    assert float(bm.ll_reg_loss(anchor, m, phi, 0.25, 0.0, 0.3, anchor)) == 0.0
    # no centre = the origin (the paper's κ‖θ‖²)
    torch.testing.assert_close(bm.ll_reg_grad(theta, m, phi, 0.25, 0.7, 0.3),
                               bm.ll_reg_grad(theta, m, phi, 0.25, 0.7, 0.3, torch.zeros(d)))


def test_ridge_key_default_and_choices():
    base = {"strategy": "bigfl", "task": "synthetic-multicenter", "nodes": 4}
    assert parse_run_config(base).params.ridge == "proximal" == bg.BiGFLParams().ridge
    assert parse_run_config({**base, "bigfl.ridge": "origin"}).params.ridge == "origin"
    with pytest.raises(ConfigError, match="bigfl.ridge"):
        parse_run_config({**base, "bigfl.ridge": "zero"})


def _isolated_client_rounds(ridge: str, kappa: float, rounds: int, lr: float) -> tuple[float, float]:
    """The real BiG-FL client of B2 (smooth generator, client 0 of 50, B2's optimiser) as an
    isolated node with φ = I (so ``R_i = ‖θ_i(φ − I)‖² = 0``): its LL is the data loss plus the
    ridge. ``rounds`` rounds, each starting from the previous round's model. Returns the final
    local test MSE and the zero predictor's."""
    from graphfl.bench import multicenter as mc
    from graphfl.client.handler import build_runtime
    from graphfl.common.types import Payload

    n = 50
    cfg = parse_run_config({"strategy": "bigfl", "task": "synthetic-multicenter-smooth", "nodes": n,
                            "engine": "inprocess", **mc.TRAIN, "train.lr": lr, "bigfl.ridge": ridge,
                            "bigfl.kappa": kappa})
    rt = build_runtime(cfg, 0, n)
    arrays = {k: v.detach().numpy().copy() for k, v in rt.ctx.task.build_model().state_dict().items()}
    d = sum(v.size for v in arrays.values())
    extra = {bg.M_KEY: np.zeros(d, np.float32), bg.PHI_KEY: np.eye(d, dtype=np.float32)}
    for r in range(1, rounds + 1):
        res = rt.trainer.fit(r, Payload({**arrays, **extra}, {bg.A_II_KEY: 1.0, bg.WANT_HESS_KEY: False}), {})
        arrays = dict(res.arrays)
    test = rt.trainer.evaluate(Payload(arrays), {})["test_loss"]
    zero = float(np.mean(np.asarray(rt.ctx.data.y_test, np.float64) ** 2))
    return float(test), zero


def test_proximal_ridge_does_not_shrink_the_ll_solution_to_the_zero_model():
    """With the paper's centre 0 the client ends at the zero predictor's test MSE (on B2's
    1/60-scaled data the ridge's minimiser is the zero model for every κ ≥ 0.01); with the
    proximal centre (the default) the same client, κ and steps learn."""
    kappa, rounds, lr = 0.03, 30, 3.0
    prox, zero = _isolated_client_rounds("proximal", kappa, rounds, lr)
    origin, _ = _isolated_client_rounds("origin", kappa, rounds, lr)
    assert origin >= 0.9 * zero, (origin, zero)  # the defect: pulled to the zero model
    assert prox <= 0.5 * zero, (prox, zero)


@pytest.mark.parametrize("centre", ["origin", "elsewhere"])
def test_hypergradient_matches_fd_of_the_converged_bilevel_objective_with_any_ridge_centre(float64, centre):
    """The ridge centre is constant in φ, so the implicit hypergradient (same ``J_Θ``, same
    ``∂F/∂φ``) is the derivative of the converged bilevel objective for any centre."""
    from tests.test_bigfl_c2 import D, N, NonlinearBilevel, _directional_fd

    prob = NonlinearBilevel()
    if centre == "elsewhere":
        anchor = torch.tensor(np.random.default_rng(7).standard_normal((N, D)))
        base = prob.pseudo_grad
        prob.pseudo_grad = lambda theta, phi: base(theta, phi) - prob.kappa * anchor  # type: ignore[method-assign]
    p = bg.BiGFLParams()
    grad, info = prob.hypergradient(mode=p.hypergrad_mode, solver=p.solver, tol=p.solver_tol,
                                    max_iter=p.solver_max_iter, neumann_c=p.neumann_c)
    assert info.converged
    rng = np.random.default_rng(3)
    for _ in range(3):
        e = torch.tensor(rng.standard_normal((D, D)))
        e = e / e.norm()
        assert float((grad * e).sum()) == pytest.approx(_directional_fd(prob, e), rel=1e-3, abs=1e-9)
