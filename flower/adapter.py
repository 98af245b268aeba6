"""A Flower ``Strategy`` over one of graphfl's pure server cores, for a user's own ServerApp.

:class:`GraphflStrategy` is the second adapter of the cores (beside graphfl's own runner,
``graphfl.server``): it implements Flower's hooks, so Flower's ``Strategy.start`` drives it
and Flower's ``Result`` is filled by Flower itself. The rules it follows:

* **Clients.** The core numbers clients ``0..n-1`` (partition ids). ``n`` is ``num_clients``,
  else the number of nodes connected when round 1 is configured. A node's partition id is, in
  this order: the user's ``partition_of`` mapping (node id -> partition id), the
  ``"partition-id"`` metric its replies report (which re-addresses the node), else the rank of
  its node id among the nodes seen at round 1 (later nodes take the free ids in order).
* **Payloads.** Each sampled client gets its own ``"arrays"`` (the core's payload for it;
  identical payloads share one ``ArrayRecord``) and a ``"config"`` holding Flower's
  ``train_config``, ``"server-round"`` and the core's scalars. Arrays the core sends beside the
  model (pFedGraph's cluster model) travel as :data:`~graphfl.flower.keys.ANCHOR`, only when the
  client term that reads them is on.
* **Replies.** ``"arrays"`` and ``"metrics"["num-examples"]`` (Flower's quickstart form). A reply
  that failed, lacks them, or whose arrays differ from the model (keys, shapes, NaN/Inf) is left
  out with a warning naming the node; the core keeps that client's previous model.
* **Client cooperation.** Where the algorithm's client half adds a term to the local loss
  (:meth:`GraphflStrategy.regulariser`), the config says which
  (:data:`~graphfl.flower.keys.REGULARISER`) and every train reply must confirm it
  (:data:`~graphfl.flower.keys.APPLIED`, set by :func:`graphfl.flower.client.graphfl_mod`); a
  reply without the confirmation stops the run with a :class:`CooperationError` naming what to add
  (:meth:`GraphflStrategy.cooperation_steps`). Where the client's part includes its evaluation
  (APFL's personal output, :meth:`GraphflStrategy.evaluate_term`), evaluate replies must confirm it too.
* **Client graph.** Strategies that read one (BiG-FL) take it as an ``n×n`` adjacency over
  partition ids (:meth:`GraphflStrategy.client_graph`); a graph of another size is an error.
* **Metrics.** ``aggregate_train`` returns the example-weighted mean of the clients' numeric
  train metrics plus the core's scalar and flat-list server metrics; ``aggregate_evaluate`` the
  weighted mean of the evaluation metrics. Every core metric (nested lists included) stays in
  :attr:`GraphflStrategy.server_metrics`, every client's evaluation in
  :attr:`GraphflStrategy.client_evaluations`.
* **Result.** ``aggregate_train`` returns the core's single model where it has one (FedAvg,
  FedProx, FedGATE; Flower puts it into ``Result.arrays``), else ``None``.
* **Wrappers.** Strategies with one global model (``global_model = True``) send the ``arrays``
  Flower passes to ``configure_train`` and return the new global model, so Flower's wrappers
  (e.g. ``DifferentialPrivacyServerSideFixedClipping``) compose as with Flower's ``FedAvg``. The
  others keep a model per client or per cluster inside the core: a wrapper's clipping (against
  one global model) and its noise (on the returned aggregate, which no client receives) would not
  act on what is released, so a call from a wrapper is refused (:class:`WrapperRefused`).
"""

from __future__ import annotations

import logging
import random
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from graphfl.common import registry
from graphfl.common.arrays import validate_update
from graphfl.common.config import RunConfig, TrainConfig, build_dataclass
from graphfl.common.core import ServerContext, ServerCore
from graphfl.common.types import Arrays, ClientUpdate, MetricValue, Payload
from graphfl.flower import keys

logger = logging.getLogger(__name__)

NODE_WAIT_POLL_S = 0.2
"""Interval between ``grid.get_node_ids()`` calls while waiting for ``min_available_nodes``."""


class CooperationError(RuntimeError):
    """A train reply lacks the client term the algorithm needs (the message says what to add)."""


class WrapperRefused(TypeError):
    """A per-client strategy was called by a Strategy wrapper whose maths assumes one global model."""


@dataclass(frozen=True)
class ClientReply:
    """One reply in plain form: the node, and its content or its error."""

    node_id: int
    content: RecordDict | None = None
    error: str | None = None


def record_to_numpy(record: ArrayRecord) -> Arrays:
    """``{key: ndarray}`` of an ``ArrayRecord`` (its key order kept)."""
    return {k: np.asarray(record[k].numpy()) for k in record.keys()}


def numpy_to_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """An ``ArrayRecord`` of named numpy arrays."""
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})


def weighted_metrics(rows: Sequence[tuple[float, Mapping[str, Any]]], skip: Iterable[str] = ()) -> dict[str, float]:
    """Example-weighted mean of each numeric metric over the rows that have it (Flower's rule)."""
    skipped = set(skip)
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for weight, metrics in rows:
        for key, value in metrics.items():
            if key in skipped or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            sums[key] = sums.get(key, 0.0) + weight * float(value)
            weights[key] = weights.get(key, 0.0) + weight
    return {k: sums[k] / weights[k] for k in sums if weights[k] > 0}


def metric_record(values: Mapping[str, MetricValue]) -> MetricRecord:
    """The scalar and flat numeric-list entries of ``values`` as a ``MetricRecord`` (others dropped)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, bool):
            out[key] = int(value)
        elif isinstance(value, (int, float)):
            out[key] = value
        elif isinstance(value, list) and value and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                       for v in value):
            out[key] = [float(v) for v in value] if any(isinstance(v, float) for v in value) else list(value)
    return MetricRecord(out)


class GraphflStrategy(Strategy):
    """A Flower ``Strategy`` running the graphfl core ``algorithm`` (module docstring for the rules).

    Subclasses (:mod:`graphfl.flower.strategies`) fix ``algorithm`` and take the algorithm's
    hyperparameters as keyword arguments; the keyword arguments below are common to all.

    Parameters
    ----------
    params
        The algorithm's hyperparameter dataclass (built by the subclass).
    fraction_train
        Share of the clients sampled each round, ``max(1, round(fraction·n))`` (graphfl's rule,
        seeded by ``seed``); 1.0 = every client.
    fraction_evaluate
        Share of the clients asked to evaluate after each round (0 = no client evaluation).
    min_available_nodes
        Nodes to wait for before round 1 (bounded by ``wait_timeout`` seconds).
    num_clients
        Size of the federation ``n`` (default: the nodes connected at round 1).
    partition_of
        Optional ``{node_id: partition_id}``; otherwise see the module docstring.
    param_keys
        Keys of the trainable arrays (default: every floating-point array); the others are
        buffers, which the cores average instead of using in their maths.
    seed
        Seed of the core (k-means++ seeding, ...) and of the client sampling.
    wait_timeout
        Seconds to wait for ``min_available_nodes`` before raising ``TimeoutError``.
    """

    algorithm: ClassVar[str] = ""
    global_model: ClassVar[bool] = False
    """One model for every client (FedAvg, FedProx): payloads are the ``arrays`` Flower passes."""

    def __init__(self, params: Any, *, fraction_train: float = 1.0, fraction_evaluate: float = 1.0,
                 min_available_nodes: int = 2, num_clients: int | None = None,
                 partition_of: Mapping[int, int] | None = None, param_keys: Sequence[str] | None = None,
                 seed: int = 0, wait_timeout: float = 300.0) -> None:
        if not 0.0 <= fraction_train <= 1.0 or not 0.0 <= fraction_evaluate <= 1.0:
            raise ValueError(f"fraction_train = {fraction_train} and fraction_evaluate = {fraction_evaluate} "
                             "must lie in [0, 1]")
        if min_available_nodes < 1:
            raise ValueError(f"min_available_nodes = {min_available_nodes} must be >= 1")
        if num_clients is not None and num_clients < 1:
            raise ValueError(f"num_clients = {num_clients} must be >= 1")
        self.params = params
        self.fraction_train = float(fraction_train)
        self.fraction_evaluate = float(fraction_evaluate)
        self.min_available_nodes = int(min_available_nodes)
        self.num_clients = num_clients
        self.param_keys = tuple(param_keys) if param_keys is not None else None
        self.seed = int(seed)
        self.wait_timeout = float(wait_timeout)
        self.core: ServerCore[Any] | None = None
        self.template: Arrays = {}
        self.pid_of_node: dict[int, int] = {int(k): int(v) for k, v in (partition_of or {}).items()}
        self._fixed_mapping = partition_of is not None
        self._unused: set[int] = set()
        self._rng = random.Random(self.seed)
        self._eval_rng = random.Random(self.seed + 1)
        self.server_metrics: dict[int, dict[str, MetricValue]] = {}
        """Round -> every metric the core logged (cluster assignments, learned graphs, ...)."""
        self.client_evaluations: dict[int, dict[int, dict[str, float]]] = {}
        """Round -> partition id -> that client's evaluation metrics."""

    @staticmethod
    def make_params(cls: type, section: str, **values: Any) -> Any:
        """``cls(**values)`` with graphfl's checks (bounds, choices); a bad value is a ``ConfigError``
        naming ``section.key``.
        """
        return build_dataclass(cls, {k.replace("_", "-"): v for k, v in values.items()}, section)

    # -- what subclasses may override -------------------------------------------------
    def regulariser(self) -> tuple[str, dict[str, Any]] | None:
        """The client term the local loss needs (:data:`keys.PROXIMAL` / :data:`keys.COSINE` / ...,
        several joined by :data:`keys.TERM_SEP`, and its config values: numbers, strings or lists of
        strings), or ``None`` when a stock ClientApp does what the algorithm needs.
        """
        return None

    def evaluate_term(self) -> tuple[str, dict[str, Any]] | None:
        """The client's part in evaluation (config of every evaluate message), or ``None``:
        :data:`keys.OWN_MODEL` (the client's own model) or :data:`keys.PERSONAL` (APFL's personal
        output, which the reply must confirm).
        """
        reg = self.regulariser()
        return (keys.OWN_MODEL, {}) if reg is not None and reg[0] == keys.OWN_MODEL else None

    def cooperation_steps(self) -> str:
        """What a ClientApp adds for this strategy's client term (the text of :class:`CooperationError`)."""
        return ("`app = ClientApp(mods=[graphfl.flower.client.graphfl_mod])` and, in the train function, "
                "`loss = loss + graphfl.flower.client.regulariser(msg)(model)`")

    def client_graph(self) -> tuple[np.ndarray, str] | None:
        """The client graph the core reads (adjacency over partition ids, and where it came from)."""
        return None

    def train_settings(self) -> TrainConfig:
        """What the core may read of the clients' local training (graphfl's defaults here; FedGATE's
        δ update needs the clients' step and local steps).
        """
        return TrainConfig()

    def summary(self) -> None:
        """Log the strategy's settings (Flower calls this at the start of ``start``)."""
        reg = self.regulariser()
        logger.info("graphfl %s (%s): fraction_train=%s, fraction_evaluate=%s, client term: %s, params %s",
                    type(self).__name__, self.algorithm, self.fraction_train, self.fraction_evaluate,
                    "none (stock ClientApp)" if reg is None else reg[0], self.params)

    # -- clients ----------------------------------------------------------------------
    @property
    def n(self) -> int:
        """Number of clients of the core (0 before round 1)."""
        return 0 if self.core is None else int(self.core.ctx.num_clients)

    def node_of(self, partition_id: int) -> int | None:
        """The node currently serving ``partition_id``, if any."""
        for nid, pid in self.pid_of_node.items():
            if pid == partition_id:
                return nid
        return None

    def _wait_nodes(self, grid: Grid) -> list[int]:
        deadline = time.monotonic() + self.wait_timeout
        while True:
            ids = sorted(int(i) for i in grid.get_node_ids())
            if len(ids) >= self.min_available_nodes or (self.core is not None and ids):
                return ids
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{type(self).__name__}: only {len(ids)} of min_available_nodes = "
                                   f"{self.min_available_nodes} nodes connected within {self.wait_timeout:.0f} s")
            time.sleep(NODE_WAIT_POLL_S)

    def _admit(self, node_ids: Sequence[int]) -> None:
        """Give unknown nodes the free partition ids in order (none left: the node is ignored)."""
        if self._fixed_mapping:
            return
        taken = set(self.pid_of_node.values())
        free = [p for p in range(self.n) if p not in taken]
        for nid in node_ids:
            if nid in self.pid_of_node:
                continue
            if not free:
                if nid not in self._unused:
                    logger.warning("%s: node %d has no free partition id (n = %d); it is not used",
                                   type(self).__name__, nid, self.n)
                    self._unused.add(nid)
                continue
            self.pid_of_node[nid] = free.pop(0)

    def start_core(self, arrays: Arrays, node_ids: Sequence[int]) -> None:
        """Build the core for the initial model ``arrays`` and the nodes seen at round 1."""
        mapped = max(self.pid_of_node.values(), default=-1) + 1
        n = self.num_clients or max(len(node_ids), mapped)
        bad = {nid: pid for nid, pid in self.pid_of_node.items() if not 0 <= pid < n}
        if bad:
            raise ValueError(f"partition_of maps nodes to partition ids outside 0..{n - 1}: {bad}")
        keys_ = self.param_keys or tuple(k for k, v in arrays.items() if v.dtype.kind == "f")
        missing = [k for k in keys_ if k not in arrays]
        if missing:
            raise ValueError(f"param_keys {missing} are not arrays of the initial model {list(arrays)[:8]}")
        spec = registry.get(self.algorithm)
        cfg = RunConfig(strategy=self.algorithm, nodes=n, seed=self.seed, fraction_train=self.fraction_train,
                        train=self.train_settings(), params=self.params)
        if n < spec.min_clients:
            raise ValueError(f"{type(self).__name__} needs at least {spec.min_clients} clients, got {n}")
        if spec.preflight is not None:
            spec.preflight(cfg, arrays, tuple(keys_))
        self.template = dict(arrays)
        graph = self.client_graph()
        if graph is not None and np.shape(graph[0]) != (n, n):
            raise ValueError(f"{type(self).__name__}: the client graph is {np.shape(graph[0])}, but the federation "
                             f"has n = {n} clients (num_clients or the nodes connected at round 1)")
        ctx = ServerContext(config=cfg, params=self.params, num_clients=n, initial_arrays=self.template,
                            param_keys=tuple(keys_), num_examples={}, seed=self.seed,
                            client_graph=None if graph is None else graph[0],
                            graph_source="" if graph is None else graph[1])
        self.core = spec.server_core(ctx)
        self._admit(node_ids)

    def _sample(self, pids: list[int], fraction: float, rng: random.Random) -> list[int]:
        if fraction >= 1.0:
            return sorted(pids)
        if fraction <= 0.0 or not pids:
            return []
        k = max(1, int(round(fraction * len(pids))))
        return sorted(rng.sample(sorted(pids), k))

    def _live(self, node_ids: Sequence[int]) -> dict[int, int]:
        """Partition id -> node for the listed nodes that have one."""
        self._admit(node_ids)
        live = set(node_ids)
        return {pid: nid for nid, pid in sorted(self.pid_of_node.items()) if nid in live}

    # -- pure halves of the hooks ------------------------------------------------------
    def _content(self, server_round: int, payload: Payload, config: ConfigRecord,
                 cache: dict[int, ArrayRecord]) -> RecordDict:
        model = {k: v for k, v in payload.arrays.items() if k in self.template}
        extra = {k: v for k, v in payload.arrays.items() if k not in self.template}
        key = id(payload.arrays)
        if key not in cache:
            cache[key] = numpy_to_record(model)
        cfg = ConfigRecord({**dict(config), **dict(payload.config)})
        cfg[keys.SERVER_ROUND] = int(server_round)
        content = RecordDict({keys.ARRAYS: cache[key], keys.CONFIG: cfg})
        reg = self.regulariser()
        if reg is not None:
            name, values = reg
            cfg[keys.REGULARISER] = name
            for k, v in values.items():
                cfg[k] = _config_value(v)
            anchor = self.anchor_arrays(extra)
            if anchor:
                content[keys.ANCHOR] = numpy_to_record(anchor)
        return content

    def anchor_arrays(self, extra: Arrays) -> Arrays:
        """Arrays of :data:`keys.ANCHOR` from the core's non-model payload arrays (none by default)."""
        return {}

    def reply_arrays(self, reply: ClientReply, content: RecordDict) -> Arrays:
        """The arrays of a train reply the core folds in: its ``"arrays"`` (BiG-FL adds its Hessian)."""
        return record_to_numpy(content.array_records[keys.ARRAYS])

    def train_contents(self, server_round: int, node_ids: Sequence[int], arrays: Arrays,
                       config: ConfigRecord) -> list[tuple[int, RecordDict]]:
        """``(node_id, content)`` of every train message of ``server_round`` (Flower-free half of
        :meth:`configure_train`); ``arrays`` is what Flower passed (used by global-model strategies).
        """
        if self.core is None:
            self.start_core(arrays, node_ids)
        assert self.core is not None
        live = self._live(node_ids)
        cache: dict[int, ArrayRecord] = {}
        shared = Payload(arrays) if self.global_model else None
        out = []
        for pid in self._sample(list(live), self.fraction_train, self._rng):
            payload = self.core.configure_train(server_round, pid)
            if payload is None:
                continue
            if shared is not None:
                payload = Payload(shared.arrays, payload.config)
            out.append((live[pid], self._content(server_round, payload, config, cache)))
        return out

    def _reply_pid(self, reply: ClientReply, metrics: Mapping[str, Any]) -> int | None:
        reported = metrics.get(keys.PARTITION_ID)
        if reported is not None and not self._fixed_mapping:
            pid = int(reported)
            if float(reported) != pid or not 0 <= pid < self.n:
                logger.warning("node %d reports partition-id %r outside 0..%d; reply ignored",
                               reply.node_id, reported, self.n - 1)
                return None
            for other, p in list(self.pid_of_node.items()):
                if p == pid and other != reply.node_id:
                    # the reporting node takes the id; the other node gets this node's old id
                    old = self.pid_of_node.get(reply.node_id)
                    if old is None:
                        del self.pid_of_node[other]
                    else:
                        self.pid_of_node[other] = old
            self.pid_of_node[reply.node_id] = pid
            return pid
        return self.pid_of_node.get(reply.node_id)

    def _metrics(self, content: RecordDict) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for rec in content.metric_records.values():
            out.update(dict(rec.items()))
        return out

    def _require_cooperation(self, reply: ClientReply, metrics: Mapping[str, Any]) -> None:
        reg = self.regulariser()
        if reg is None or metrics.get(keys.APPLIED) == 1:
            return
        name, values = reg
        setting = ", ".join(f"{k.removeprefix('graphfl.')}={_shown(v)}" for k, v in values.items()
                            if isinstance(v, (int, float)))
        why = ("its train function did not add the term to the loss" if keys.APPLIED in metrics
               else "the ClientApp has no graphfl_mod")
        if name == keys.OWN_MODEL:
            raise CooperationError(
                f"{type(self).__name__} needs each client to keep its own model, but the reply of node "
                f"{reply.node_id} does not confirm it (the ClientApp has no graphfl_mod). Add "
                "`app = ClientApp(mods=[graphfl.flower.client.graphfl_mod])` to the ClientApp "
                f"({self.off_hint()}).")
        raise CooperationError(
            f"{type(self).__name__} ({setting}) needs the client term {name!r} in the local loss, but the "
            f"reply of node {reply.node_id} does not confirm it ({why}). Add it to the ClientApp: "
            f"{self.cooperation_steps()}; or switch the term off ({self.off_hint()}).")

    def off_hint(self) -> str:
        """How to run this strategy without the client term (for :class:`CooperationError`)."""
        return "see the strategy's docstring"

    def fold_train(self, server_round: int, replies: Iterable[ClientReply]) -> tuple[ArrayRecord | None, MetricRecord]:
        """Validate the replies and fold them into the core (Flower-free half of :meth:`aggregate_train`)."""
        assert self.core is not None, "aggregate_train before configure_train"
        updates: dict[int, ClientUpdate] = {}
        rows: list[tuple[float, Mapping[str, Any]]] = []
        for reply in replies:
            if reply.error is not None or reply.content is None:
                logger.warning("round %d: node %d failed: %s", server_round, reply.node_id, reply.error)
                continue
            metrics = self._metrics(reply.content)
            pid = self._reply_pid(reply, metrics)
            if pid is None:
                logger.warning("round %d: reply of unknown node %d ignored", server_round, reply.node_id)
                continue
            self._require_cooperation(reply, metrics)
            why = None
            if keys.ARRAYS not in reply.content.array_records:
                why = f"no ArrayRecord {keys.ARRAYS!r} (the trained model) in the reply"
            elif not isinstance(metrics.get(keys.NUM_EXAMPLES), (int, float)) or metrics[keys.NUM_EXAMPLES] < 0:
                why = f"no non-negative metric {keys.NUM_EXAMPLES!r} in the reply's MetricRecord"
            arrays: Arrays = {}
            if why is None:
                arrays = self.reply_arrays(reply, reply.content)
                why = validate_update(arrays, self.core.update_template(pid))
            if why is not None:
                logger.warning("round %d: reply of node %d (client %d) left out: %s",
                               server_round, reply.node_id, pid, why)
                continue
            n_ex = int(metrics[keys.NUM_EXAMPLES])
            updates[pid] = ClientUpdate(pid, arrays, n_ex, {k: float(v) for k, v in metrics.items()
                                                             if isinstance(v, (int, float))})
            rows.append((float(n_ex), metrics))
        server = dict(self.core.aggregate_train(server_round, updates))
        self.server_metrics[server_round] = server
        agg = weighted_metrics(rows, skip=(keys.NUM_EXAMPLES, keys.PARTITION_ID, keys.APPLIED))
        record = metric_record({**agg, **{k: v for k, v in server.items() if k not in agg}})
        final = self.core.final_arrays()
        return (numpy_to_record(final) if final is not None and updates else None), record

    def evaluate_contents(self, server_round: int, node_ids: Sequence[int], config: ConfigRecord,
                          arrays: Arrays | None = None) -> list[tuple[int, RecordDict]]:
        """``(node_id, content)`` of the evaluate messages: each client's ``evaluation_payload``
        (global-model strategies: ``arrays``, what Flower passes, e.g. a wrapper's noised model).
        """
        if self.core is None:
            return []
        live = self._live(node_ids)
        cache: dict[int, ArrayRecord] = {}
        out = []
        for pid in self._sample(list(live), self.fraction_evaluate, self._eval_rng):
            payload = self.core.evaluation_payload(pid)
            model = arrays if self.global_model and arrays is not None else payload.arrays
            key = id(model)
            if key not in cache:
                cache[key] = numpy_to_record({k: v for k, v in model.items() if k in self.template})
            cfg = ConfigRecord({**dict(config), keys.SERVER_ROUND: int(server_round)})
            term = self.evaluate_term()
            if term is not None:   # the mod / personal_model evaluate the client's own or personal model
                cfg[keys.REGULARISER] = term[0]
                for k, v in term[1].items():
                    cfg[k] = _config_value(v)
            out.append((live[pid], RecordDict({keys.ARRAYS: cache[key], keys.CONFIG: cfg})))
        return out

    def fold_evaluate(self, server_round: int, replies: Iterable[ClientReply]) -> MetricRecord | None:
        """Weighted mean of the evaluation metrics (Flower-free half of :meth:`aggregate_evaluate`)."""
        rows: list[tuple[float, Mapping[str, Any]]] = []
        per_client: dict[int, dict[str, float]] = {}
        for reply in replies:
            if reply.error is not None or reply.content is None:
                logger.warning("round %d: evaluation of node %d failed: %s", server_round, reply.node_id, reply.error)
                continue
            metrics = self._metrics(reply.content)
            term = self.evaluate_term()
            if term is not None and term[0] == keys.PERSONAL and metrics.get(keys.APPLIED) != 1:
                raise CooperationError(
                    f"{type(self).__name__} evaluates each client's personal output, but the evaluate reply of "
                    f"node {reply.node_id} does not confirm it (the ClientApp has no graphfl_mod, or its evaluate "
                    "function did not call personal_model). Add `model = graphfl.flower.client.personal_model(msg, "
                    "context, model)` to the evaluate function, after loading msg.content['arrays'].")
            n_ex = metrics.get(keys.NUM_EXAMPLES)
            pid = self._reply_pid(reply, metrics)
            if not isinstance(n_ex, (int, float)) or pid is None:
                logger.warning("round %d: evaluation of node %d left out (no %r metric or unknown node)",
                               server_round, reply.node_id, keys.NUM_EXAMPLES)
                continue
            per_client[pid] = {k: float(v) for k, v in metrics.items()
                               if isinstance(v, (int, float)) and not isinstance(v, bool)}
            rows.append((float(n_ex), metrics))
        self.client_evaluations[server_round] = per_client
        if not rows:
            return None
        return metric_record(weighted_metrics(rows, skip=(keys.NUM_EXAMPLES, keys.PARTITION_ID, keys.APPLIED)))

    # -- Flower's hooks ----------------------------------------------------------------
    def _refuse_wrapper(self, hook: str) -> None:
        caller = sys._getframe(2).f_locals.get("self")
        if self.global_model or caller is None or caller is self or not isinstance(caller, Strategy):
            return
        raise WrapperRefused(
            f"{type(caller).__name__} cannot wrap {type(self).__name__}: {self.algorithm} releases a model per "
            f"client/cluster from its own state, while {type(caller).__name__} clips replies against one global "
            "model and transforms only the aggregate returned by aggregate_train, which no client receives here; "
            f"its guarantees would not hold ({hook}). Wrap a global-model strategy (graphfl.flower.FedAvg, "
            "FedProx) instead.")

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """One TRAIN message per sampled node, each with that client's own ``"arrays"``."""
        self._refuse_wrapper("configure_train")
        node_ids = self._wait_nodes(grid)
        contents = self.train_contents(server_round, node_ids, record_to_numpy(arrays), config)
        return [Message(content, dst_node_id=nid, message_type=MessageType.TRAIN, group_id=str(server_round))
                for nid, content in contents]

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Fold the replies into the core; the global model for global-model strategies, else ``None``."""
        self._refuse_wrapper("aggregate_train")
        return self.fold_train(server_round, [_plain(m) for m in replies])

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """One EVALUATE message per sampled node with the model that client is evaluated on."""
        if self.fraction_evaluate <= 0.0:
            return []
        node_ids = sorted(int(i) for i in grid.get_node_ids())
        contents = self.evaluate_contents(server_round, node_ids, config, record_to_numpy(arrays))
        return [Message(content, dst_node_id=nid, message_type=MessageType.EVALUATE, group_id=str(server_round))
                for nid, content in contents]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Example-weighted mean of the clients' evaluation metrics."""
        return self.fold_evaluate(server_round, [_plain(m) for m in replies])

    # -- results -----------------------------------------------------------------------
    def client_arrays(self, partition_id: int) -> Arrays:
        """The model client ``partition_id`` is evaluated on now (its center, its personalised model...)."""
        if self.core is None:
            raise RuntimeError(f"{type(self).__name__}: no round has run yet")
        payload = self.core.evaluation_payload(partition_id)
        return {k: v for k, v in payload.arrays.items() if k in self.template}


def _config_value(value: Any) -> Any:
    """A hyperparameter as a ``ConfigRecord`` value: strings, bools and lists of strings as they are,
    numbers as floats.
    """
    if isinstance(value, (str, bool)):
        return value
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return float(value)


def _shown(value: Any) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def _plain(msg: Message) -> ClientReply:
    node = int(msg.metadata.src_node_id)
    if msg.has_error():
        return ClientReply(node, error=f"client error {msg.error.code}: {msg.error.reason}")
    return ClientReply(node, content=msg.content)

