"""A test-only algorithm ("probe") that makes per-node payloads and client state observable.

Loaded into SuperNodes' ClientApps through ``GRAPHFL_PLUGINS=graphfl.tests.probe_strategy``.
Server: client ``pid`` receives the initial model with ``pid + 1000·round`` added to the
first array and ``probe.tag = pid + 1000·round`` in its config. Client: counts its training
rounds in ``context.state`` and reports the tag it saw, the sum of the first array and
its count. The core checks all three and reports them as server metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from graphfl.common.core import ClientTrainer, ServerCore
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
