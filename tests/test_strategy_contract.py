"""Contract of every registered (built-in) strategy, run through the real round loop in-process.

One run per strategy, 4 clients, 4 rounds, with injected faults:

* round 1: client 0 fails (error reply);
* round 2: client 1 uploads NaN;
* round 3: every client fails (a round with no valid update);
* round 4: everyone answers.

Required of every strategy:

* the run completes; the failures are recorded per client; the final evaluation is finite;
* **updates matter**: the payloads sent after round 2 (valid updates from clients 0, 2, 3)
  differ from those sent in round 2, and the payloads sent after round 3 (no valid update)
  equal those of round 3 — for every phase of the plan and for the evaluation payloads;
* and each strategy's own rule (:data:`EXPECTED`): e.g. FedAvg's next payload *is* the
  sample-weighted average of the accepted uploads, FeSEM's is the mean of the client's cluster.

Test-only algorithms (``graphfl.tests``) are left out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import pytest

from graphfl.common import registry, wire
from graphfl.common.arrays import weighted_average
from graphfl.common.config import parse_run_config
from graphfl.common.core import ServerCore
from graphfl.common.types import Arrays, Payload
from graphfl.server.exchange import Reply, Request
from graphfl.server.inprocess import InProcessExchange, server_inputs
from graphfl.server.recorder import RunRecorder
from graphfl.server.rounds import ServerInputs, run_federated

FAILURES = {(1, 0): "error", (2, 1): "nan", **{(3, pid): "error" for pid in range(4)}}
ACCEPTED_IN_ROUND_2 = (0, 2, 3)


def builtin_strategies() -> list[str]:
    return [n for n in registry.names() if not registry.get(n).server_core.__module__.startswith("graphfl.tests")]


@dataclass
class Trace:
    """What the exchange carried: payloads by (round, phase, pid), replies by (round, phase, pid)."""

    payloads: dict[tuple[int, str, int], Payload] = field(default_factory=dict)
    replies: dict[tuple[int, str, int], Reply] = field(default_factory=dict)

    def sent(self, r: int, phase: str) -> dict[int, Payload]:
        return {pid: p for (rr, ph, pid), p in self.payloads.items() if rr == r and ph == phase}

    def uploads(self, r: int, phase: str = "fit") -> dict[int, Reply]:
        return {pid: rep for (rr, ph, pid), rep in self.replies.items() if rr == r and ph == phase}


class RecordingExchange(InProcessExchange):
    def __init__(self, cfg, fail):
        super().__init__(cfg, fail)
        self.trace = Trace()

    def send(self, request: Request, payloads: Mapping[int, Payload]) -> dict[int, Reply]:
        replies = super().send(request, payloads)
        for pid, p in payloads.items():
            self.trace.payloads[(request.server_round, request.phase, pid)] = p
            self.trace.replies[(request.server_round, request.phase, pid)] = replies[pid]
        return replies


@dataclass
class ContractRun:
    name: str
    doc: dict
    core: ServerCore
    trace: Trace
    inputs: ServerInputs
    eval_payloads: dict[int, dict[int, Payload]]
    """``core.evaluation_payload(pid)`` right after round r, by r."""

    @property
    def curve(self) -> list[dict]:
        return self.doc["methods"][self.name]["curve"]


_RUNS: dict[str, ContractRun] = {}


def contract_run(name: str) -> ContractRun:
    """One faulty 4-round run per strategy, shared by the tests below."""
    if name not in _RUNS:
        # min-replies = 0: round 3 (every client fails) must be survived by the core, not end the run
        cfg = parse_run_config({"strategy": name, "task": "digits", "nodes": 4, "rounds": 4, "engine": "inprocess",
                                "train.local-steps": 2, "train.lr": 0.1, "min-replies": 0})
        inputs = server_inputs(cfg)
        exchange = RecordingExchange(cfg, FAILURES)
        spec = registry.get(name)
        cores: list[ServerCore] = []
        evals: dict[int, dict[int, Payload]] = {}

        def build(ctx):
            cores.append(spec.server_core(ctx))
            return cores[-1]

        def after_round(event):
            if event["event"] == "round" and cores:
                evals[event["round"]] = {pid: cores[0].evaluation_payload(pid) for pid in range(4)}

        recorder = RunRecorder(cfg, name, None, progress=after_round)
        core = run_federated(cfg, dataclasses.replace(spec, server_core=build), exchange, inputs, recorder)
        _RUNS[name] = ContractRun(name, recorder.document(), core, exchange.trace, inputs, evals)
    return _RUNS[name]


def same_arrays(a: Arrays, b: Arrays) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def same_payload(a: Payload, b: Payload) -> bool:
    return same_arrays(a.arrays, b.arrays) and dict(a.config) == dict(b.config)


def phases_of(run: ContractRun, r: int) -> list[str]:
    return [ph["phase"] for ph in run.curve[r]["phases"]]


@pytest.mark.parametrize("name", builtin_strategies())
def test_failed_nan_and_empty_rounds_are_survived(name):
    run = contract_run(name)
    curve = run.curve
    assert run.doc["status"] == "completed"
    assert curve[1]["failed"] == {"0": "injected failure"}
    assert "NaN" in curve[2]["failed"]["1"] and set(curve[2]["failed"]) == {"1"}
    assert curve[3]["clients_ok"] == 0 and len(curve[3]["failed"]) == 4
    assert curve[4]["clients_ok"] == 4 and "failed" not in curve[4]
    final = run.doc["methods"][name]["final"]["test_loss"]
    assert final is not None and math.isfinite(final)


@pytest.mark.parametrize("name", builtin_strategies())
def test_valid_updates_change_the_payloads_and_an_empty_round_changes_nothing(name):
    run = contract_run(name)
    for phase in phases_of(run, 3):
        before, after_updates = run.trace.sent(2, phase), run.trace.sent(3, phase)
        after_nothing = run.trace.sent(4, phase)
        assert set(after_nothing) == set(after_updates) == set(range(4))
        changed = [pid for pid in range(4) if not same_payload(before[pid], after_updates[pid])]
        assert changed, f"{name}: no payload of phase {phase} changed after a round of valid updates"
        unchanged = [pid for pid in range(4) if same_payload(after_updates[pid], after_nothing[pid])]
        assert unchanged == list(range(4)), f"{name}: phase {phase} payloads moved after a round with no update"
    # evaluation payloads (snapshot after each round): moved by round 2, untouched by round 3
    ev = run.eval_payloads
    assert any(not same_payload(ev[1][pid], ev[2][pid]) for pid in range(4)), f"{name}: evaluation ignores updates"
    assert all(same_payload(ev[2][pid], ev[3][pid]) for pid in range(4)), f"{name}: empty round moved evaluation"


# ---------------------------------------------------------------------------------------
# each strategy's own rule, checked on the payloads sent in round 3 (after round 2's
# accepted uploads from clients 0, 2, 3; client 1's NaN upload was rejected)
# ---------------------------------------------------------------------------------------


def _accepted_uploads(run: ContractRun, r: int) -> dict[int, Reply]:
    ok = run.trace.uploads(r)
    return {pid: ok[pid] for pid in sorted(ok) if ok[pid].error is None and str(pid) not in run.curve[r].get("failed", {})}


def _check_fedavg(run: ContractRun) -> None:
    ups = _accepted_uploads(run, 2)
    assert sorted(ups) == list(ACCEPTED_IN_ROUND_2)
    weighted = run.core.params.weighted
    expect = weighted_average([u.arrays for u in ups.values()],
                              [u.num_examples if weighted else 1.0 for u in ups.values()])
    for pid, payload in run.trace.sent(3, "fit").items():
        for k in expect:
            np.testing.assert_allclose(payload.arrays[k], expect[k], rtol=0, atol=0, err_msg=f"client {pid} {k}")


def _check_local(run: ContractRun) -> None:
    initial = run.inputs.initial_arrays
    sent2, sent3 = run.trace.sent(2, "fit"), run.trace.sent(3, "fit")
    assert same_arrays(sent2[0].arrays, initial)                   # client 0 failed round 1: still the init
    assert all(sent2[p].arrays == {} for p in (1, 2, 3))            # the others train their own model
    assert all(sent3[p].arrays == {} for p in range(4))             # client 0 trained in round 2


def _check_fesem(run: ContractRun) -> None:
    latest: dict[int, Arrays] = {}
    for r in (1, 2):
        for pid, rep in _accepted_uploads(run, r).items():
            assert rep.arrays is not None
            latest[pid] = rep.arrays
    assign = run.curve[2]["server"]["assignment"]
    for pid, payload in run.trace.sent(3, "fit").items():
        members = [q for q in range(4) if assign[q] == assign[pid] and q in latest]
        for k, ref in run.inputs.initial_arrays.items():
            mean = np.mean([latest[q][k].astype(np.float64) for q in members], axis=0).astype(ref.dtype)
            np.testing.assert_allclose(payload.arrays[k], mean, rtol=1e-6, atol=1e-7, err_msg=f"client {pid} {k}")


def _check_bigfl(run: ContractRun) -> None:
    from graphfl.strategies.bigfl import M_KEY, PHI_KEY

    ups = _accepted_uploads(run, 2)
    core = run.core
    sent2, sent3 = run.trace.sent(2, "fit"), run.trace.sent(3, "fit")
    # φ ← φ − α ĝ/‖ĝ‖_F. digits has no client graph, so BiG-FL runs on the complete fallback graph,
    # where Â = 11ᵀ/n maps the centred parameters Θ − 1θ̄ᵀ to H = 0: no UL signal, ĝ = 0, no step.
    assert core.graph_source.startswith("complete")
    assert run.curve[2]["server"]["hypergrad_norm"] == 0.0 and run.curve[2]["server"]["phi_step"] == 0.0
    np.testing.assert_array_equal(sent2[0].arrays[PHI_KEY], sent3[0].arrays[PHI_KEY])
    for pid in ACCEPTED_IN_ROUND_2:                                                   # own θ_i comes back
        for k in core.keys:
            np.testing.assert_array_equal(sent3[pid].arrays[k], ups[pid].arrays[k])
    if core.other_keys:                                                               # others = fedavg
        shared = weighted_average([{k: u.arrays[k] for k in core.other_keys} for u in ups.values()],
                                  [u.num_examples for u in ups.values()])
        for k in core.other_keys:
            np.testing.assert_array_equal(sent3[0].arrays[k], shared[k])
    assert all(M_KEY in p.arrays for p in sent3.values())


def _check_gate(run: ContractRun) -> None:
    """apfl / fedgate / apflgate: u_i = w − w_i, ū = uniform mean over accepted, w ← w − γ ū."""
    from graphfl.strategies.fedgate import ACCEPTED_KEY, ROUND_KEY, U_PREFIX

    ups = _accepted_uploads(run, 2)
    assert sorted(ups) == list(ACCEPTED_IN_ROUND_2)
    w2 = {k: v for k, v in run.trace.sent(2, "fit")[0].arrays.items() if not k.startswith(U_PREFIX)}
    gamma = run.core.params.gamma
    tracking = run.name != "apfl"
    for key, w in w2.items():
        u = [w.astype(np.float64) - ups[p].arrays[key].astype(np.float64) for p in ACCEPTED_IN_ROUND_2]
        u_bar = (u[0] + u[1] + u[2]) / 3.0
        expect = (w.astype(np.float64) - gamma * u_bar).astype(w.dtype)
        for pid, payload in run.trace.sent(3, "fit").items():
            np.testing.assert_array_equal(payload.arrays[key], expect, err_msg=f"client {pid} {key}")
            if tracking and key in run.inputs.param_keys:
                np.testing.assert_allclose(payload.arrays[U_PREFIX + key], u_bar.astype(w.dtype), rtol=0, atol=0)
    for pid, payload in run.trace.sent(3, "fit").items():
        if tracking:
            assert payload.config == {ROUND_KEY: 2, ACCEPTED_KEY: pid in ACCEPTED_IN_ROUND_2}
        else:
            assert set(payload.arrays) == set(w2) and not payload.config


def _latest_uploads(run: ContractRun, upto: int = 2) -> dict[int, Reply]:
    latest: dict[int, Reply] = {}
    for r in range(1, upto + 1):
        latest.update(_accepted_uploads(run, r))
    return dict(sorted(latest.items()))


def _rows(run: ContractRun, arrays_by_pid: Mapping[int, Arrays]) -> np.ndarray:
    keys = run.inputs.param_keys
    return np.stack([np.concatenate([np.asarray(a[k], dtype=np.float64).ravel() for k in keys])
                     for a in arrays_by_pid.values()])


def _check_payload_rows(run: ContractRun, expect: np.ndarray, pids, rtol=1e-5, atol=1e-6, prefix="") -> None:
    keys = run.inputs.param_keys
    sent3 = run.trace.sent(3, "fit")
    for j, pid in enumerate(pids):
        got = np.concatenate([np.asarray(sent3[pid].arrays[prefix + k], dtype=np.float64).ravel() for k in keys])
        np.testing.assert_allclose(got, expect[j], rtol=rtol, atol=atol, err_msg=f"client {pid}")


def _check_jgesr(run: ContractRun) -> None:
    from graphfl.strategies import jgesr_math as jm

    latest = _latest_uploads(run)
    assert sorted(latest) == [0, 1, 2, 3]   # client 1 keeps its round-1 upload
    y = _rows(run, {p: r.arrays for p, r in latest.items()}).astype(np.float32)
    sizes = [r.num_examples for r in latest.values()]
    # the set of clients changed between rounds 1 ({1,2,3}) and 2 (all): a cold start, cosine graph
    expect = jm.solve_pdca(y, None, sizes, run.core.params.solver_params())
    _check_payload_rows(run, expect.psi.astype(np.float64), list(latest))
    graph = np.asarray(run.curve[2]["server"]["graph"])
    np.testing.assert_allclose(graph, expect.graph, atol=1e-6)
    assert np.allclose(graph, graph.T) and (graph >= 0).all() and not np.diag(graph).any()
    sent3 = run.trace.sent(3, "fit")   # a model per client: the restored rows differ
    assert not same_arrays(sent3[0].arrays, sent3[2].arrays)


def _check_cfl(run: ContractRun) -> None:
    ups = _accepted_uploads(run, 2)
    sent2 = run.trace.sent(2, "fit")
    # warm-up (20 rounds): one cluster; every client gets its sent model + the uniform mean update
    du = _rows(run, {p: ups[p].arrays for p in ups}) - _rows(run, {p: sent2[p].arrays for p in ups})
    mean_update = du.mean(axis=0)
    start = _rows(run, {p: sent2[p].arrays for p in range(4)})
    _check_payload_rows(run, start + mean_update, range(4))
    assert run.curve[2]["server"]["assignment"] == [0, 0, 0, 0]


def _cosines(v: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(v, axis=1)
    return (v @ v.T) / np.outer(norms, norms)


def _check_fedamp(run: ContractRun) -> None:
    latest = _latest_uploads(run)
    w = _rows(run, {p: r.arrays for p, r in latest.items()})
    init = _rows(run, {0: run.inputs.initial_arrays})[0]
    cos = _cosines(w - init)
    xi = np.zeros((4, 4))
    for i in range(4):   # ξ_ii = 0.3, the rest 0.7 softmax(10 cos) over the others
        others = [j for j in range(4) if j != i]
        e = np.exp(10.0 * cos[i, others])
        xi[i, others] = 0.7 * e / e.sum()
        xi[i, i] = 0.3
    _check_payload_rows(run, xi @ w, list(latest))


def _simplex(v: np.ndarray) -> np.ndarray:
    lo, hi = v.min() - 1.0, v.max()   # bisection on τ: Σ max(v − τ, 0) = 1
    for _ in range(200):
        tau = 0.5 * (lo + hi)
        lo, hi = (tau, hi) if np.maximum(v - tau, 0).sum() > 1 else (lo, tau)
    return np.maximum(v - 0.5 * (lo + hi), 0)


def _check_pfedgraph(run: ContractRun) -> None:
    from graphfl.strategies.pfedgraph import CLUSTER_PREFIX

    latest = _latest_uploads(run)
    w = _rows(run, {p: r.arrays for p, r in latest.items()})
    init = _rows(run, {0: run.inputs.initial_arrays})[0]
    cos = _cosines(w - init)
    cos[cos > 0.9] = 1.0
    sizes = np.array([r.num_examples for r in latest.values()], dtype=float)
    a = np.stack([_simplex(sizes / sizes.sum() + cos[i] / (2 * 0.8)) for i in range(4)])
    assert np.allclose(a.sum(axis=1), 1) and (a >= 0).all()
    _check_payload_rows(run, a @ w, list(latest))
    _check_payload_rows(run, a @ (w / np.linalg.norm(w, axis=1, keepdims=True)), list(latest), prefix=CLUSTER_PREFIX)
    np.testing.assert_allclose(np.asarray(run.curve[2]["server"]["graph"]), a, atol=1e-5)


EXPECTED: dict[str, Callable[[ContractRun], None]] = {
    "apfl": _check_gate, "fedgate": _check_gate, "apflgate": _check_gate,
    "fedavg": _check_fedavg, "fedprox": _check_fedavg, "local": _check_local,
    "fesem": _check_fesem, "bigfl": _check_bigfl, "jgesr": _check_jgesr, "cfl": _check_cfl,
    "fedamp": _check_fedamp, "pfedgraph": _check_pfedgraph,
}


def test_every_builtin_strategy_has_its_own_rule_checked():
    assert sorted(EXPECTED) == sorted(builtin_strategies())


@pytest.mark.parametrize("name", builtin_strategies())
def test_updates_change_the_state_the_way_the_algorithm_says(name):
    if name not in EXPECTED:
        pytest.fail(f"strategy {name!r} has no rule in tests/test_strategy_contract.py EXPECTED")
    EXPECTED[name](contract_run(name))


def test_wire_phase_names_reach_the_exchange():
    run = contract_run("fedavg")
    kinds = {(r, ph) for (r, ph, _) in run.trace.payloads}
    assert {(r, "fit") for r in range(1, 5)} <= kinds and (5, "evaluate") in kinds
    assert wire.PHASE.startswith(wire.CONTROL_PREFIX)
