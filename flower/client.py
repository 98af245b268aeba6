"""Client helpers for a user's own ClientApp: a Flower mod and the local-loss terms.

Where an algorithm needs a term in the client's local loss (FedProx's proximal term, FedAMP's
pull towards the cloud model, FeSEM's eq. 10.10, pFedGraph's similarity term), a ClientApp
written as in Flower's quickstarts adds two lines::

    from graphfl.flower.client import graphfl_mod, regulariser

    app = ClientApp(mods=[graphfl_mod])

    @app.train()
    def train(msg, context):
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        reg = regulariser(msg)                      # zero when the strategy asks for nothing
        for x, y in batches:
            loss = loss_fn(model(x), y) + reg(model)
            ...

:func:`regulariser` reads the message's config (:data:`~graphfl.flower.keys.REGULARISER` and
its values) and returns ``reg(model) -> tensor``; :func:`graphfl_mod` confirms in the reply's
``"metrics"`` (:data:`~graphfl.flower.keys.APPLIED`) that the term was evaluated during the call,
which the strategy requires (else it stops with an error naming these two lines). The mod also
reports the node config's ``partition-id`` in the reply's metrics when the reply does not.
The terms are graphfl's own client terms (:func:`graphfl.client.objective.proximal_term`,
:func:`graphfl.client.objective.cosine_term`), over the model's ``named_parameters``.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message
from torch import nn

from graphfl.client.objective import Penalty, cosine_term, linear_term, proximal_term
from graphfl.flower import keys
from graphfl.strategies.apfl_math import client_update, delta_update
from graphfl.strategies.fedgate import ACCEPTED_KEY, ROUND_KEY

_APPLIED: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("graphfl_applied", default=None)

Regulariser = Callable[[nn.Module], torch.Tensor]


def requested(msg: Message) -> str | None:
    """The client term a train message asks for (``None``: none)."""
    config = msg.content.config_records.get(keys.CONFIG)
    value = None if config is None else config.get(keys.REGULARISER)
    return None if value is None else str(value)


def regulariser(msg: Message) -> Regulariser:
    """The local-loss term the strategy asks for in ``msg`` as ``reg(model) -> scalar tensor``.

    * :data:`~graphfl.flower.keys.PROXIMAL`: ``μ/2 Σ_k ‖θ_k − θ_k^received‖²`` over the model's
      parameters, the anchor being the message's ``"arrays"`` (``μ`` = config ``graphfl.mu``);
    * :data:`~graphfl.flower.keys.COSINE`: ``−λ ⟨c, θ⟩/‖θ‖`` with ``c`` the ArrayRecord
      ``graphfl.anchor`` (``λ`` = config ``graphfl.lam``); zero when no anchor was sent yet;
    * nothing asked: zero.

    Each call of ``reg`` records (for :func:`graphfl_mod`) that the term entered the loss.

    Raises
    ------
    ValueError
        For a term this graphfl version does not know (the message names it).
    """
    name = requested(msg)
    if name is None or name == keys.OWN_MODEL:   # the mod does local-only training's part
        return _zero
    config = msg.content.config_records[keys.CONFIG]
    if name == keys.PROXIMAL:
        anchor = {k: np.asarray(v.numpy()) for k, v in msg.content.array_records[keys.ARRAYS].items()}
        mu = float(config[keys.MU])  # type: ignore[arg-type]
        term = _lazy_keys(lambda ks: proximal_term(anchor, mu, ks))
    elif name == keys.GATE:
        record = msg.content.array_records.get(keys.DELTA)
        if record is None:   # no δ yet (before the client's first update is in a ū)
            term = _zero
        else:
            delta = {k: np.asarray(v.numpy()) for k, v in record.items()}
            term = _lazy_keys(lambda ks: linear_term(delta, tuple(k for k in ks if k in delta)))
    elif name == keys.COSINE:
        record = msg.content.array_records.get(keys.ANCHOR)
        if record is None:
            term = _zero
        else:
            cluster = {k: np.asarray(v.numpy()) for k, v in record.items()}
            lam = float(config[keys.LAM])  # type: ignore[arg-type]
            term = _lazy_keys(lambda ks: cosine_term(cluster, lam, ks))
    else:
        raise ValueError(f"the strategy asks for the client term {name!r}, which this graphfl version does not "
                         f"know (known: {[keys.PROXIMAL, keys.COSINE, keys.GATE, keys.OWN_MODEL]})")

    def reg(model: nn.Module) -> torch.Tensor:
        applied = _APPLIED.get()
        if applied is not None:
            applied.add(name)
        return term(model)

    return reg


def _zero(model: nn.Module) -> torch.Tensor:
    return torch.zeros(())


def _lazy_keys(build: Callable[[tuple[str, ...]], Penalty]) -> Regulariser:
    """A term over the model's parameter names, built on the first call (when the model is known)."""
    built: list[Penalty] = []

    def term(model: nn.Module) -> torch.Tensor:
        params = dict(model.named_parameters())
        if not built:
            device = str(next(iter(params.values())).device)
            built.append(build(tuple(params)).to(device))
        return built[0](params)

    return term


def graphfl_mod(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """Flower client mod: keeps a client's own model and confirms the client term.

    * :data:`~graphfl.flower.keys.OWN_MODEL` (local-only training): a message with an empty
      ``"arrays"`` gets the client's own model from ``context.state`` before the ClientApp sees
      it, and a train reply's ``"arrays"`` is stored there as the new own model.
    * :data:`~graphfl.flower.keys.GATE` (FedGATE, ALGORITHMS.md §9.2): before the ClientApp runs,
      ``δ_i ← δ_i + (u_i − ū)/(η τ)`` when the message's ``ū`` (``graphfl.anchor``, round
      ``gate.round``) includes this client's last upload (``gate.accepted``), and ``δ_i`` goes into
      the message as ``graphfl.delta`` for :func:`regulariser`; after it, ``u_i = w − w_i`` of this
      upload is kept for the next round (``context.state``, :data:`~graphfl.flower.keys.GATE_STATE`).
      The kept ``u_i`` is dropped at the next train message either way, as in graphfl's own client.
    * Then the ClientApp runs; a reply with a ``"metrics"`` MetricRecord gets
      :data:`~graphfl.flower.keys.APPLIED` = 1 when the requested term (if any) was evaluated
      through :func:`regulariser` during the call (else 0), and ``partition-id`` from the node
      config when the reply has none.

    Raises
    ------
    ValueError
        Local-only training asks for the own model before this client stored one (it missed
        round 1); the message says so.
    """
    pid = context.node_config.get(keys.PARTITION_ID)
    name = requested(msg)
    if name == keys.OWN_MODEL:
        _put_own_model(msg, context)
    if name == keys.GATE:
        _gate_before(msg, context)
    token = _APPLIED.set(set())
    try:
        reply = call_next(msg, context)
        applied = _APPLIED.get() or set()
    finally:
        _APPLIED.reset(token)
    if reply.has_error():
        return reply
    if name == keys.GATE and keys.ARRAYS in reply.content.array_records:
        _gate_after(msg, reply, context)
    if name == keys.OWN_MODEL and keys.ARRAYS in reply.content.array_records:
        own = reply.content.array_records[keys.ARRAYS]
        context.state[keys.OWN_STATE] = ArrayRecord({k: own[k] for k in own.keys()})
        applied.add(name)
    metrics_rec = reply.content.metric_records.get(keys.METRICS)
    if metrics_rec is None:
        return reply
    if name is not None:
        metrics_rec[keys.APPLIED] = 1 if name in applied else 0
    if pid is not None and keys.PARTITION_ID not in metrics_rec:
        metrics_rec[keys.PARTITION_ID] = int(pid)
    return reply


def _put_own_model(msg: Message, context: Context) -> None:
    """Local-only training: an empty ``"arrays"`` becomes the own model kept in ``context.state``."""
    sent = msg.content.array_records.get(keys.ARRAYS)
    if sent is not None and len(sent.keys()) > 0:
        return
    own = context.state.array_records.get(keys.OWN_STATE)
    if own is None:
        raise ValueError(f"local-only training: the server sent no model and this client (partition "
                         f"{context.node_config.get(keys.PARTITION_ID)}) has no own model in its context.state "
                         "yet (it has not trained since the run started)")
    msg.content[keys.ARRAYS] = ArrayRecord({k: own[k] for k in own.keys()})


def _gate_before(msg: Message, context: Context) -> None:
    """FedGATE: the pending δ update, then ``δ_i`` into the message (see :func:`graphfl_mod`)."""
    config = msg.content.config_records[keys.CONFIG]
    state = context.state
    delta_key, up_key, meta_key = (f"{keys.GATE_STATE}.{part}" for part in ("delta", "up", "meta"))
    up = state.array_records.get(up_key)
    meta = state.config_records.get(meta_key)
    delta = {k: np.asarray(v.numpy()) for k, v in state.array_records[delta_key].items()} \
        if delta_key in state.array_records else None
    if up is not None and meta is not None:
        u_i = {k: np.asarray(v.numpy()) for k, v in up.items()}
        del state[up_key]
        del state[meta_key]
        u_bar_rec = msg.content.array_records.get(keys.ANCHOR)
        if (u_bar_rec is not None and int(config.get(ROUND_KEY, 0)) == int(meta["up-round"])  # type: ignore[arg-type]
                and bool(config.get(ACCEPTED_KEY, False))):
            u_bar = {k: np.asarray(v.numpy()) for k, v in u_bar_rec.items()}
            old = {k: (delta[k] if delta is not None and k in delta else np.zeros(np.shape(u_bar[k])))
                   for k in u_bar}
            delta = delta_update(old, {k: u_i[k] for k in u_bar}, u_bar, float(config[keys.ETA]),  # type: ignore[arg-type]
                                 float(config[keys.TAU]))  # type: ignore[arg-type]
            state[delta_key] = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in delta.items()})
    if delta is not None:
        msg.content[keys.DELTA] = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in delta.items()})


def _gate_after(msg: Message, reply: Message, context: Context) -> None:
    """FedGATE: keep ``u_i = w − w_i`` of this upload and its round for the next δ update."""
    sent = msg.content.array_records[keys.ARRAYS]
    trained = reply.content.array_records[keys.ARRAYS]
    common = [k for k in trained.keys() if k in sent.keys()]
    u_i = client_update({k: np.asarray(sent[k].numpy()) for k in common},
                        {k: np.asarray(trained[k].numpy()) for k in common})
    config = msg.content.config_records[keys.CONFIG]
    context.state[f"{keys.GATE_STATE}.up"] = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in u_i.items()})
    context.state[f"{keys.GATE_STATE}.meta"] = ConfigRecord({"up-round": int(config[keys.SERVER_ROUND])})  # type: ignore[arg-type]
