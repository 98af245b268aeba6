"""Validation views of tasks: tune on a split of each client's *training* data, never on test.

``validation_task("synthetic-multicenter")`` registers (once) and returns the name
``"synthetic-multicenter+val"``: the same task whose clients train on 80 % of their training
split and are "tested" on the held-out 20 % of it (``VALIDATION_FRACTION``). The real test
split is never touched, so a benchmark may pick hyperparameters by the "test" metrics of the
``+val`` task and then run the chosen settings on the original task (full training split,
real test split).

The split is a random permutation per client, seeded by ``(task seed, client id)``, so every
process and every method sees the same validation samples.
"""

from __future__ import annotations

import numpy as np

from graphfl.common.types import ClientData
from graphfl.tasks import registry
from graphfl.tasks.base import Task, TaskSpec

VALIDATION_SUFFIX = "+val"
VALIDATION_FRACTION = 0.2
_SPLIT_STREAM = 9901


def split_validation(data: ClientData, seed: int, partition_id: int,
                     fraction: float = VALIDATION_FRACTION) -> ClientData:
    """``ClientData(train', y_train', val, y_val)``: ``val`` is ``fraction`` of the training rows.

    ``train'`` and ``val`` partition the training split (disjoint, nothing from the test split).
    At least one row stays on each side when the split has two or more rows.
    """
    m = len(data.x_train)
    if m < 2:
        raise ValueError(f"client {partition_id}: {m} training sample(s) cannot be split for validation")
    n_val = min(m - 1, max(1, int(round(fraction * m))))
    order = np.random.default_rng([int(seed), _SPLIT_STREAM, int(partition_id)]).permutation(m)
    val, train = np.sort(order[:n_val]), np.sort(order[n_val:])
    return ClientData(data.x_train[train], data.y_train[train], data.x_train[val], data.y_train[val],
                      collate=data.collate)


def validation_task(name: str) -> str:
    """Register ``<name>+val`` (if needed) and return that name; ``name`` must be a task."""
    if name.endswith(VALIDATION_SUFFIX):
        return name
    base = registry.get(name)  # ConfigError listing the valid tasks
    val_name = name + VALIDATION_SUFFIX
    if val_name in registry.names():
        return val_name

    def client_data(self: Task, partition_id: int, num_partitions: int) -> ClientData:
        full = base.client_data(self, partition_id, num_partitions)
        return self.holdout_view(split_validation(full, self.seed, partition_id))

    spec = TaskSpec(val_name, base.spec.kind, base.spec.default_nodes,
                    summary=f"{name} with 20% of each client's training data held out as its 'test' split "
                            "(validation; the real test split is unused)",
                    needs_data_dir=base.spec.needs_data_dir)
    cls = type(base.__name__ + "Validation", (base,), {"spec": spec, "client_data": client_data,
                                                       "__doc__": f"Validation view of {name!r}."})
    registry.register_task(cls)
    return val_name
