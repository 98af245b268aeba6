"""Test-only algorithms that make per-node payloads, client state and round plans observable.

Loaded into SuperNodes' ClientApps through ``GRAPHFL_PLUGINS=graphfl.tests.probe_strategy``.

"probe" (one phase):
Server: client ``pid`` receives the initial model with ``pid + 1000·round`` added to the
first array and ``probe.tag = pid + 1000·round`` in its config. Client: counts its training
rounds in ``context.state`` and reports the tag it saw, the sum of the first array and
its count. The core checks all three and reports them as server metrics.

"probe-mix" / "probe-mix-pb" (two phases per round; separate / piggy-backed evaluation):
see the comment above :class:`MixProbeCore`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from graphfl.common.core import ClientTrainer, Phase, ServerCore
from graphfl.common.registry import AlgorithmSpec, ClientSpec, register, register_client
from graphfl.common.types import FitResult, Payload


@dataclass(frozen=True)
class ProbeParams:
    pass


def tag(pid: int, server_round: int) -> int:
    return pid + 1000 * server_round


class ProbeCore(ServerCore):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.first = next(iter(ctx.initial_arrays))
        self.base_sum = float(ctx.initial_arrays[self.first].sum())
        self.size = ctx.initial_arrays[self.first].size

    def configure_train(self, server_round, partition_id):
        arrays = dict(self.ctx.initial_arrays)
        arrays[self.first] = arrays[self.first] + np.float32(tag(partition_id, server_round))
        return Payload(arrays, {"probe.tag": tag(partition_id, server_round)})

    def aggregate_train(self, server_round, updates):
        tags_ok, sums_ok, counts = [], [], {}
        for pid, up in updates.items():
            expected = tag(pid, server_round)
            tags_ok.append(int(up.metrics["probe.tag"]) == expected)
            sums_ok.append(abs(up.metrics["probe.sum"] - (self.base_sum + expected * self.size)) < 1e-2 * self.size)
            counts[str(pid)] = int(up.metrics["probe.count"])
        return {"tags_ok": all(tags_ok), "sums_ok": all(sums_ok), "counts": counts}

    def evaluation_payload(self, partition_id):
        return Payload(dict(self.ctx.initial_arrays))


class ProbeTrainer(ClientTrainer):
    def fit(self, server_round, payload, state):
        count = int(state.get("count", np.zeros(())).item()) + 1
        state["count"] = np.asarray(count)
        first = next(iter(payload.arrays))
        metrics = {"probe.tag": float(payload.config["probe.tag"]),
                   "probe.sum": float(payload.arrays[first].astype(np.float64).sum()),
                   "probe.count": float(count)}
        return FitResult(dict(payload.arrays), self.ctx.data.num_train, metrics)

    def evaluate(self, payload, state):
        return {"test_loss": float(state.get("count", np.zeros(())).item()), "num_test": 1.0}


register(AlgorithmSpec("probe", ProbeParams, ProbeCore, "test probe"))
register_client(ClientSpec("probe", ProbeTrainer))


# ---------------------------------------------------------------------------------------
# "probe-mix": a two-phase round (upload -> per-client mixture -> reply), for round plans
# ---------------------------------------------------------------------------------------
#
# Phase "fit": client i receives x = (r, r, ...) and uploads u_i = mean of the first DIM
# features of its training data + 0.5·r·(i+1) (float32), keeping u_i in its state.
# Phase "mix" (only clients whose phase-1 upload was valid): client i receives
# m_i = Σ_j w_ij u_j with w_ij ∝ exp(-‖u_i − u_j‖²) over this round's uploaders (float64),
# and replies with m_i − u_i (from its *state*, float64) and the dot product m_i·u_i.
# The server checks every residual exactly and reports the dots. Evaluation: the mean of
# (m_i − u_i)² for the last mixture m_i the client received.

MIX_DIM = 4
MIX_ROUND_KEY = "probe-mix.round"
STATE_U = "probe-mix.u"
STATE_ROUND = "probe-mix.round"


@dataclass(frozen=True)
class MixProbeParams:
    pass


def client_vector(x_train: np.ndarray, pid: int, server_round: int) -> np.ndarray:
    """u_i of the module comment (float32)."""
    base = np.asarray(x_train, dtype=np.float64)[:, :MIX_DIM].mean(axis=0)
    return (base + 0.5 * server_round * (pid + 1)).astype(np.float32)


def mixture(u: dict[int, np.ndarray], pid: int) -> np.ndarray:
    """m_i = Σ_j w_ij u_j, w_ij ∝ exp(-‖u_i − u_j‖²) over the uploaders ``u`` (float64)."""
    ids = sorted(u)
    own = u[pid].astype(np.float64)
    logits = np.array([-float(np.sum((own - u[j].astype(np.float64)) ** 2)) for j in ids])
    w = np.exp(logits - logits.max())
    w /= w.sum()
    return np.sum([wj * u[j].astype(np.float64) for wj, j in zip(w, ids)], axis=0)


class MixProbeCore(ServerCore[MixProbeParams]):
    piggyback_eval = False

    def __init__(self, ctx):
        super().__init__(ctx)
        self.uploads: dict[int, np.ndarray] = {}
        self.sent: dict[int, np.ndarray] = {}
        self.last_mix: dict[int, np.ndarray] = {}

    def round_plan(self, server_round):
        return (
            Phase("fit", self.configure_upload, self.aggregate_upload, lambda pid: {"u": np.zeros(MIX_DIM, np.float32)}),
            Phase("mix", self.configure_mix, self.aggregate_mix, lambda pid: {"r": np.zeros(MIX_DIM, np.float64)}),
        )

    def configure_upload(self, server_round, partition_id):
        return Payload({"x": np.full(MIX_DIM, server_round, np.float32)}, {MIX_ROUND_KEY: server_round})

    def aggregate_upload(self, server_round, updates):
        self.uploads = {pid: up.arrays["u"] for pid, up in updates.items()}
        self.sent = {}
        return {"uploads": sorted(self.uploads)}

    def configure_mix(self, server_round, partition_id):
        if partition_id not in self.uploads:
            return None
        m = mixture(self.uploads, partition_id)
        self.sent[partition_id] = m
        return Payload({"m": m}, {MIX_ROUND_KEY: server_round})

    def aggregate_mix(self, server_round, updates):
        ok = []
        for pid, up in updates.items():
            expected = self.sent[pid] - self.uploads[pid].astype(np.float64)
            ok.append(bool(np.array_equal(up.arrays["r"], expected)))
            self.last_mix[pid] = self.sent[pid]
        return {"mix_ok": all(ok), "mixed": sorted(updates),
                "dots": {str(pid): up.metrics["probe-mix.dot"] for pid, up in sorted(updates.items())}}

    def evaluation_payload(self, partition_id):
        return Payload({"m": self.last_mix.get(partition_id, np.zeros(MIX_DIM))})


class PiggybackMixProbeCore(MixProbeCore):
    """The same plan with piggy-backed evaluation (the first phase's payload is evaluated)."""

    piggyback_eval = True


class MixProbeTrainer(ClientTrainer[MixProbeParams]):
    def fit(self, server_round, payload, state):
        if not np.array_equal(payload.arrays["x"], np.full(MIX_DIM, server_round, np.float32)):
            raise ValueError(f"phase fit of round {server_round} got x = {payload.arrays['x']}")
        u = client_vector(self.ctx.data.x_train, self.ctx.partition_id, server_round)
        state[STATE_U] = u
        # 1-element, not 0-d: common.records.arrays_to_record turns 0-d arrays into shape (1,)
        # (np.ascontiguousarray), so a 0-d state entry would come back 1-d in deployment only
        state[STATE_ROUND] = np.array([server_round])
        return FitResult({"u": u}, self.ctx.data.num_train, {"train_loss": float(u.astype(np.float64).sum())})

    def fit_phase(self, phase, server_round, payload, state):
        if phase != "mix":
            return super().fit_phase(phase, server_round, payload, state)
        if STATE_U not in state or int(state[STATE_ROUND][0]) != server_round:
            raise RuntimeError(f"client {self.ctx.partition_id}: phase mix of round {server_round} without "
                               "this round's upload in its state")
        if int(payload.config[MIX_ROUND_KEY]) != server_round:
            raise ValueError("mixture of another round")
        u = state[STATE_U].astype(np.float64)
        m = payload.arrays["m"]
        return FitResult({"r": m - u}, self.ctx.data.num_train, {"probe-mix.dot": float(m @ u)})

    def evaluate(self, payload, state):
        m = payload.arrays.get("m")
        if m is None:
            return {"test_loss": 0.0, "num_test": 1.0}
        u = state[STATE_U].astype(np.float64) if STATE_U in state else np.zeros(MIX_DIM)
        return {"test_loss": float(np.mean((m - u) ** 2)), "num_test": 1.0}


register(AlgorithmSpec("probe-mix", MixProbeParams, MixProbeCore, "test probe: two-phase rounds"))
register_client(ClientSpec("probe-mix", MixProbeTrainer))
register(AlgorithmSpec("probe-mix-pb", MixProbeParams, PiggybackMixProbeCore,
                       "test probe: two-phase rounds, piggy-backed evaluation"))
register_client(ClientSpec("probe-mix-pb", MixProbeTrainer))
