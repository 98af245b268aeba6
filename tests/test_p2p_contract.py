"""Contract test: every registered p2p algorithm, under both runtimes.

Parametrised over :func:`graphfl.p2p.algorithms.registry.names`, so a new algorithm is covered
by registering it (with an ``example`` configuration). For each algorithm:

* in one process: the threaded transport driver (:func:`run_node` over ``InProcessTransport``)
  gives the in-process driver's iterates bit for bit, and an in-process checkpoint round trip
  (save at round r, restore, continue) equals the uninterrupted run;
* as real peer processes (``graphfl peer`` started by :class:`PeerProcesses` from a network file
  written by the launcher: 127.0.0.1, free ports, a fresh CA, mutual TLS), one network per
  algorithm, all networks side by side and shared by the tests below:

  A. ``R1`` rounds: final states (θ, tracker, aux, per-edge state) == in-process, to 1e-6;
  B. every peer restarted with ``--resume --set rounds=R2``: == an uninterrupted in-process
     ``R2``-round run (checkpoint round trip across processes);
  C. restarted again with ``--resume --set rounds=R3``, paced; peer 2 is killed (SIGKILL)
     mid-run: the others finish, each round without it is skipped within the deadline and
     recorded.
"""

from __future__ import annotations

import json
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from graphfl.deploy.p2p_launch import PeerProcesses, prepare_network
from graphfl.p2p import checkpoint
from graphfl.p2p.algorithms import NodeContext, NodeState, registry
from graphfl.p2p.config import NetworkFile, load_network_file
from graphfl.p2p.driver import run_network_inprocess, run_node
from graphfl.p2p.exchange import FailurePolicy, NeighbourExchange
from graphfl.p2p.oracles import ProblemSpec, make_oracle
from graphfl.p2p.peer import problem_spec
from graphfl.p2p.topology import make_topology
from graphfl.p2p.transport import InProcessHub

NAMES = registry.names()
N = 3
R1, R2, R3 = 3, 5, 12
KILLED = 2
ROUND_TIMEOUT_C = 3.0
PHASE_TIMEOUT = 90.0


def example(name: str, **more: Any) -> dict[str, Any]:
    """The algorithm's registered example, on a tiny problem."""
    spec = registry.get(name)
    return {"algorithm": name, "dim": 4, "samples": 40, "batch-size": 5, "seed": 7, **spec.example, **more}


def problem(name: str, n: int) -> ProblemSpec:
    ex = example(name)
    return ProblemSpec(str(ex["problem"]), num_nodes=n, seed=ex["seed"], batch_size=ex["batch-size"], dim=ex["dim"],
                       samples=ex["samples"])


def algorithm(name: str):
    spec = registry.get(name)
    return spec.create(spec.make_params({k: v for k, v in example(name).items() if k in spec.param_keys()}))


def assert_same_state(got: NodeState, want: NodeState, atol: float, what: str) -> None:
    assert got.t == want.t, what
    np.testing.assert_allclose(got.theta, want.theta, rtol=0, atol=atol, err_msg=f"{what}: theta")
    assert (got.tracker is None) == (want.tracker is None), what
    if want.tracker is not None:
        np.testing.assert_allclose(got.tracker, want.tracker, rtol=0, atol=atol, err_msg=f"{what}: tracker")
    assert sorted(got.aux) == sorted(want.aux), what
    for k in want.aux:
        np.testing.assert_allclose(got.aux[k], want.aux[k], rtol=0, atol=atol, err_msg=f"{what}: aux {k}")
    assert sorted(got.edges) == sorted(want.edges), what
    for j in want.edges:
        assert sorted(got.edges[j]) == sorted(want.edges[j]), what
        for k in want.edges[j]:
            np.testing.assert_allclose(got.edges[j][k], want.edges[j][k], rtol=0, atol=atol, err_msg=f"{what}: edge {j} {k}")


# ---------------------------------------------------------------------------------------------
# one process
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_threaded_node_loop_matches_inprocess_driver(name):
    algo = algorithm(name)
    topo = make_topology("ring", 4)
    w, adj = topo.mixing_matrix(), topo.adjacency()
    iterations = 5 * algo.period
    spec = problem(name, 4)
    oracles = [make_oracle(i, spec) for i in range(4)]
    ctxs = [NodeContext.from_matrix(w, i, adj) for i in range(4)]
    states = [algo.init(o, c) for o, c in zip(oracles, ctxs)]
    hub = InProcessHub()
    transports = [hub.transport(i, topo.neighbours(i)) for i in range(4)]
    for tr, st, c in zip(transports, states, ctxs):
        for ch, specs in algo.channels(st, c).items():
            tr.mailbox.expect(ch, specs)
    runs: dict[int, Any] = {}

    def go(i: int) -> None:
        ex = NeighbourExchange(transports[i], ctxs[i].row, FailurePolicy(round_timeout=20))
        runs[i] = run_node(algo, oracles[i], ex, iterations, ctx=ctxs[i], state=states[i])

    import threading

    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    for tr in transports:
        tr.close()
    assert sorted(runs) == [0, 1, 2, 3]
    ref = run_network_inprocess(algorithm(name), [make_oracle(i, spec) for i in range(4)], w, iterations, adjacency=adj)
    for i in range(4):
        assert_same_state(runs[i].state, ref.states[i], 0.0, f"{name} node {i}")
    assert [r["round"] for r in runs[0].records] == [r["round"] for r in ref.curve]


@pytest.mark.parametrize("name", NAMES)
def test_inprocess_checkpoint_round_trip(name, tmp_path):
    topo = make_topology("ring", 4)
    w, adj = topo.mixing_matrix(), topo.adjacency()
    spec = problem(name, 4)
    algo = algorithm(name)
    full = run_network_inprocess(algo, [make_oracle(i, spec) for i in range(4)], w, R2 * algo.period, adjacency=adj)
    run_network_inprocess(algo, [make_oracle(i, spec) for i in range(4)], w, R1 * algo.period, adjacency=adj,
                          checkpoint_dir=tmp_path)
    fresh = [make_oracle(i, spec) for i in range(4)]  # new oracles: their RNGs come from the checkpoint
    resumed = run_network_inprocess(algorithm(name), fresh, w, R2 * algo.period, adjacency=adj, resume_from=tmp_path)
    for i in range(4):
        assert_same_state(resumed.states[i], full.states[i], 0.0, f"{name} node {i}")
    assert [r["round"] for r in resumed.curve] == list(range(R1 + 1, R2 + 1))
    assert resumed.curve[-1]["test_loss"] == full.curve[-1]["test_loss"] or np.isnan(full.curve[-1]["test_loss"])


# ---------------------------------------------------------------------------------------------
# real peer processes (shared by the tests below)
# ---------------------------------------------------------------------------------------------


@dataclass
class Network:
    name: str
    out: Path
    file: Path
    net: NetworkFile
    phase: dict[str, dict[int, Any]] = field(default_factory=dict)  # phase -> peer -> checkpoint
    results: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)  # phase -> peer -> peer json
    codes: dict[str, dict[int, int | None]] = field(default_factory=dict)
    killed_at: int = -1

    def reference(self, rounds: int) -> list[NodeState]:
        algo = self.net.run.make_algorithm()
        oracles = [make_oracle(i, problem_spec(self.net, i), partition=i) for i in range(N)]
        topo = self.net.topology
        return run_network_inprocess(algo, oracles, topo.mixing_matrix(), rounds * algo.period,
                                     adjacency=topo.adjacency()).states


def _logs(nets: list[Network]) -> str:
    text = []
    for nw in nets:
        for f in sorted((nw.out / "logs").glob("*.log")):
            text.append(f"--- {nw.name} {f.name}\n" + f.read_text()[-3000:])
    return "\n".join(text)


def _wait(groups: dict[str, PeerProcesses], nets: list[Network], what: str) -> None:
    deadline = time.monotonic() + PHASE_TIMEOUT
    for g in groups.values():
        if not g.wait_all(deadline):
            for h in groups.values():
                h.stop_all()
            raise AssertionError(f"{what}: peers did not finish within {PHASE_TIMEOUT} s\n{_logs(nets)}")


def _strict_json(text: str) -> Any:
    """Parse JSON refusing ``NaN``/``Infinity`` (not JSON; other tools cannot read them)."""
    def refuse(token: str) -> Any:
        raise AssertionError(f"non-standard JSON constant {token} in a peer result file")

    return json.loads(text, parse_constant=refuse)


def _collect(nets: list[Network], groups: dict[str, PeerProcesses], phase: str) -> None:
    for nw in nets:
        nw.codes[phase] = groups[nw.name].exit_codes()
        nw.results[phase] = {i: _strict_json((nw.out / f"peer-{i}.json").read_text()) for i in range(N)}
        nw.phase[phase] = {}
        for i in range(N):
            try:
                nw.phase[phase][i] = checkpoint.load(nw.out, i)
            except checkpoint.CheckpointError:
                nw.phase[phase][i] = None
        (nw.out / phase).mkdir(exist_ok=True)
        for i in range(N):
            shutil.copy(nw.out / f"peer-{i}.json", nw.out / phase / f"peer-{i}.json")


@pytest.fixture(scope="module")
def networks(tmp_path_factory) -> dict[str, Network]:
    root = tmp_path_factory.mktemp("contract")
    nets = []
    for name in NAMES:
        out = root / name
        f = prepare_network(out, "ring", N, example(name, rounds=R1, **{
            "round-timeout": 20, "send-timeout": 10, "connect-timeout": 60}))
        net = load_network_file(f)
        assert not net.tls.insecure
        nets.append(Network(name, out, f, net))

    def phase(label: str, args: list[str], during=None) -> None:
        groups: dict[str, PeerProcesses] = {}
        try:
            for nw in nets:
                groups[nw.name] = PeerProcesses(nw.file, nw.out, range(N), args=args)
            if during is not None:
                during(groups)
            _wait(groups, nets, label)
        finally:
            for g in groups.values():
                g.stop_all()
        _collect(nets, groups, label)

    phase("A", [])
    phase("B", ["--resume", "--set", f"rounds={R2}"])

    def kill_one(groups: dict[str, PeerProcesses]) -> None:
        deadline = time.monotonic() + PHASE_TIMEOUT
        pending = {nw.name: nw for nw in nets}
        while pending and time.monotonic() < deadline:
            for name, nw in list(pending.items()):
                st = groups[name].status(KILLED)
                if st.get("state") == "running" and st.get("round", 0) >= R2 + 2:
                    groups[name].kill(KILLED)
                    nw.killed_at = int(st["round"])
                    del pending[name]
            time.sleep(0.05)
        assert not pending, f"peer {KILLED} never reached round {R2 + 2} in {sorted(pending)}\n{_logs(nets)}"

    phase("C", ["--resume", "--set", f"rounds={R3}", "--set", "min-round-seconds=0.25",
                "--set", f"round-timeout={ROUND_TIMEOUT_C}", "--set", f"send-timeout={ROUND_TIMEOUT_C}"], kill_one)
    return {nw.name: nw for nw in nets}


@pytest.mark.e2e
@pytest.mark.parametrize("name", NAMES)
def test_processes_give_the_inprocess_iterates(networks, name):
    nw = networks[name]
    assert nw.codes["A"] == {i: 0 for i in range(N)}, _logs([nw])
    ref = nw.reference(R1)
    for i in range(N):
        res = nw.results["A"][i]
        assert res["outcome"] == "done" and res["config"]["tls"] is True
        assert [r["round"] for r in res["records"]] == list(range(1, R1 + 1))
        assert all(r["missing"] == [] for r in res["records"])
        ck = nw.phase["A"][i]
        assert ck.round == R1 and ck.algorithm == name
        assert_same_state(ck.state, ref[i], 1e-6, f"{name} peer {i}")


@pytest.mark.e2e
@pytest.mark.parametrize("name", NAMES)
def test_processes_resume_from_checkpoints_as_if_uninterrupted(networks, name):
    nw = networks[name]
    assert nw.codes["B"] == {i: 0 for i in range(N)}, _logs([nw])
    ref = nw.reference(R2)
    for i in range(N):
        res = nw.results["B"][i]
        assert res["outcome"] == "done" and res["resumed_from"]["round"] == R1
        assert [r["round"] for r in res["records"]] == list(range(R1 + 1, R2 + 1))
        assert_same_state(nw.phase["B"][i].state, ref[i], 1e-6, f"{name} peer {i}")


@pytest.mark.e2e
@pytest.mark.parametrize("name", NAMES)
def test_processes_skip_a_killed_neighbour_and_finish(networks, name):
    nw = networks[name]
    codes = nw.codes["C"]
    assert codes[KILLED] == -signal.SIGKILL
    live = [i for i in range(N) if i != KILLED]
    assert all(codes[i] == 0 for i in live), _logs([nw])
    for i in live:
        res = nw.results["C"][i]
        assert res["outcome"] == "done"
        recs = res["records"]
        assert recs[-1]["round"] == R3
        skipped = [r for r in recs if KILLED in r["missing"]]
        assert skipped, f"peer {i} never recorded skipping peer {KILLED}"
        assert all(KILLED in r["missing"] for r in recs if r["round"] > nw.killed_at + 1)  # it never came back
        assert max(r["comm_s"] for r in skipped) < ROUND_TIMEOUT_C + 1.5  # each skip within the deadline
        assert all(np.isfinite(r["train_loss"]) for r in recs if r["train_loss"] is not None)
        log = (nw.out / "logs" / f"peer-{i}.log").read_text()
        assert f"skipping neighbour(s) [{KILLED}]" in log and "re-weighting (self)" in log
        ck = nw.phase["C"][i]
        assert ck.round == R3 and np.all(np.isfinite(ck.state.theta))
    # the killed peer kept every round it finished (written as it went, across --resume)
    lines = (nw.out / f"peer-{KILLED}.rounds.jsonl").read_text().splitlines()
    rounds = [_strict_json(line)["round"] for line in lines]
    assert rounds[:R2] == list(range(1, R2 + 1)) and rounds[-1] >= nw.killed_at
