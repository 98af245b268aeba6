"""Client helpers for a user's own ClientApp: a Flower mod, the local-loss terms and APFL's personal model.

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
:func:`graphfl.client.objective.cosine_term`, :func:`graphfl.client.objective.linear_term`,
:func:`graphfl.client.bigfl_trainer.ll_term`), over the model's ``named_parameters``.

APFL's personal model ``v_i`` trains on a mixed output, which no loss term can express: the
train function builds :class:`Personal` and calls its ``step`` after every optimiser step, the
evaluate function evaluates :func:`personal_model`; the mod keeps ``v_i``, ``α_i`` and the
locally trained copy in ``context.state`` across rounds.
"""

from __future__ import annotations

import contextvars
import copy
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message
from torch import nn

from graphfl.client.bigfl_trainer import data_loss_hessian, ll_term
from graphfl.client.gate_trainer import OutputMixture, personal_step
from graphfl.client.objective import Penalty, cosine_term, linear_term, proximal_term
from graphfl.flower import keys
from graphfl.strategies.apfl_math import client_update, delta_update
from graphfl.strategies.bigfl import A_II_KEY, HESS_KEY, M_KEY, PHI_KEY, WANT_HESS_KEY
from graphfl.strategies.fedgate import ACCEPTED_KEY, ROUND_KEY

_APPLIED: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("graphfl_applied", default=None)
_PERSONAL: contextvars.ContextVar[list[Personal] | None] = contextvars.ContextVar("graphfl_personal", default=None)
LOSS_TERMS = (keys.PROXIMAL, keys.COSINE, keys.GATE, keys.BIGFL)
"""Terms :func:`regulariser` adds to the loss; :data:`~graphfl.flower.keys.PERSONAL` and
:data:`~graphfl.flower.keys.OWN_MODEL` are the client's other parts (:class:`Personal`, the mod)."""

Regulariser = Callable[[nn.Module], torch.Tensor]


def requested(msg: Message) -> str | None:
    """The client term a train message asks for (``None``: none)."""
    config = msg.content.config_records.get(keys.CONFIG)
    value = None if config is None else config.get(keys.REGULARISER)
    return None if value is None else str(value)


def requested_terms(msg: Message) -> set[str]:
    """Every client term a message asks for (:data:`~graphfl.flower.keys.REGULARISER` split at
    :data:`~graphfl.flower.keys.TERM_SEP`).
    """
    name = requested(msg)
    return set() if name is None else set(name.split(keys.TERM_SEP))


def _mark(term: str) -> None:
    applied = _APPLIED.get()
    if applied is not None:
        applied.add(term)


def regulariser(msg: Message) -> Regulariser:
    """The local-loss term the strategy asks for in ``msg`` as ``reg(model) -> scalar tensor``.

    * :data:`~graphfl.flower.keys.PROXIMAL`: ``μ/2 Σ_k ‖θ_k − θ_k^received‖²`` over the model's
      parameters, the anchor being the message's ``"arrays"`` (``μ`` = config ``graphfl.mu``);
    * :data:`~graphfl.flower.keys.COSINE`: ``−λ ⟨c, θ⟩/‖θ‖`` with ``c`` the ArrayRecord
      ``graphfl.anchor`` (``λ`` = config ``graphfl.lam``); zero when no anchor was sent yet;
    * :data:`~graphfl.flower.keys.GATE`: ``−Σ_k ⟨δ_k, θ_k⟩`` with ``δ`` put in by :func:`graphfl_mod`;
    * :data:`~graphfl.flower.keys.BIGFL`: BiG-FL's lower-level term (seed 000 eq. 10.17)
      ``(λ/2)‖m_i + â_i θ φ − θ‖² + (κ/2)‖θ − c_i‖²`` over ``θ`` = the concatenated parameters
      ``graphfl.theta-keys``, with ``m_i`` and ``φ`` from ``graphfl.anchor``, ``â_i`` = config
      ``bigfl.a-ii``, ``λ`` / ``κ`` = ``graphfl.lam`` / ``graphfl.kappa`` and ``c_i`` the received
      model (``graphfl.ridge = proximal``) or 0 (``origin``): graphfl's own client term
      (:func:`graphfl.client.bigfl_trainer.ll_term` over
      :func:`graphfl.strategies.bigfl_math.ll_reg_loss`);
    * nothing asked (or only the client's other parts: its own model, APFL's personal model): zero.

    Each call of ``reg`` records (for :func:`graphfl_mod`) that the term entered the loss.

    Raises
    ------
    ValueError
        For a term this graphfl version does not know (the message names it).
    """
    terms = requested_terms(msg)
    unknown = terms - set(LOSS_TERMS) - {keys.OWN_MODEL, keys.PERSONAL}
    if unknown:
        raise ValueError(f"the strategy asks for the client term(s) {sorted(unknown)}, which this graphfl version "
                         f"does not know (known: {[*LOSS_TERMS, keys.PERSONAL, keys.OWN_MODEL]})")
    names = [t for t in LOSS_TERMS if t in terms]
    if not names:   # the mod / Personal do local-only training's and APFL's parts
        return _zero
    name = names[0]
    config = msg.content.config_records[keys.CONFIG]
    term: Regulariser
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
        term = _bigfl_term(msg, config)

    def reg(model: nn.Module) -> torch.Tensor:
        _mark(name)
        return term(model)

    return reg


def _bigfl_term(msg: Message, config: ConfigRecord) -> Regulariser:
    """BiG-FL's lower-level term of ``msg`` (see :func:`regulariser`)."""
    record = msg.content.array_records.get(keys.ANCHOR)
    if record is None or M_KEY not in record or PHI_KEY not in record:
        raise ValueError(f"a BiG-FL train message without {M_KEY!r} / {PHI_KEY!r} in {keys.ANCHOR!r}")
    theta_keys = tuple(str(k) for k in config[keys.THETA_KEYS])  # type: ignore[union-attr]
    received = msg.content.array_records[keys.ARRAYS]
    flat = np.concatenate([np.asarray(received[k].numpy(), dtype=np.float32).reshape(-1) for k in theta_keys])
    anchor = torch.as_tensor(flat) if str(config[keys.RIDGE]) == "proximal" else torch.zeros(flat.shape)
    tensors = {"m": torch.as_tensor(np.asarray(record[M_KEY].numpy(), dtype=np.float32)),
               "phi": torch.as_tensor(np.asarray(record[PHI_KEY].numpy(), dtype=np.float32)),
               "a": torch.tensor(float(config.get(A_II_KEY, 1.0)), dtype=torch.float32),  # type: ignore[arg-type]
               "anchor": anchor}
    if tuple(tensors["m"].shape) != flat.shape or tuple(tensors["phi"].shape) != flat.shape * 2:
        raise ValueError(f"BiG-FL's m_i / phi are {tuple(tensors['m'].shape)} / {tuple(tensors['phi'].shape)}, "
                         f"but theta ({', '.join(theta_keys)}) has {flat.size} entries")
    penalty = Penalty(ll_term, tensors, (theta_keys, float(config[keys.LAM]), float(config[keys.KAPPA])))  # type: ignore[arg-type]
    return _lazy_keys(lambda ks: penalty)


def bigfl_hessian(msg: Message, model: nn.Module, loss_fn: Callable[..., torch.Tensor], x: Any,
                  y: Any) -> ArrayRecord | None:
    """BiG-FL's ``implicit`` hypergradient: the Hessian of ``loss_fn(model(x), y)`` in ``θ``, or ``None``.

    ``θ`` is the concatenation of the parameters ``graphfl.theta-keys``; computed at ``model`` (the
    trained model: call it after training, on the client's training data) by graphfl's own client
    function (:func:`graphfl.client.bigfl_trainer.data_loss_hessian`, on a copy of ``model``).
    Returns the ArrayRecord to put into the train reply as ``"graphfl.hessian"``
    (:data:`~graphfl.flower.keys.HESSIAN`) when the message's config asks for it (``bigfl.hessian``),
    else ``None``.
    """
    config = msg.content.config_records.get(keys.CONFIG)
    if config is None or keys.BIGFL not in requested_terms(msg) or not bool(config.get(WANT_HESS_KEY, False)):
        return None
    theta_keys = tuple(str(k) for k in config[keys.THETA_KEYS])  # type: ignore[union-attr]
    device = str(next(model.parameters()).device)
    hess = data_loss_hessian(copy.deepcopy(model), theta_keys, x, y, loss_fn, device=device)  # type: ignore[arg-type]
    return ArrayRecord({HESS_KEY: Array(hess)})


class Personal:
    """APFL's personal model ``v_i`` in a ClientApp's train function (ALGORITHMS.md §9.1, §9.3).

    Build it after loading the received model and call :meth:`step` after every optimiser step
    of the model::

        pers = Personal(msg, context, model)
        for x, y in batches:
            ...; loss.backward(); optimizer.step()
            pers.step(model, x, y, loss_fn)

    Each :meth:`step` is graphfl's personal step
    (:func:`graphfl.client.gate_trainer.personal_step`): with ``h_w = model(x)`` of the just-updated
    copy ``w_i`` (no gradient), ``ŷ = α_i h(v_i; x) + (1 − α_i) h_w``,
    ``v_i ← v_i − η ∇_v ℓ(ŷ, y)`` (plain SGD, ``η`` = config ``graphfl.eta``) and, with
    ``graphfl.adaptive-alpha``, ``α_i ← clip_[0,1](α_i − η_α ∂ℓ(ŷ)/∂α)``. ``v_i`` starts as the
    received model and ``α_i`` as ``graphfl.alpha``; :func:`graphfl_mod` keeps both, and the
    trained ``w_i`` (the reply's ``"arrays"``: the local copy the personal output mixes with, C6),
    in ``context.state`` (:data:`~graphfl.flower.keys.APFL_STATE`). When the strategy asks for no
    personal model, :meth:`step` does nothing.
    """

    def __init__(self, msg: Message, context: Context, model: nn.Module) -> None:
        self.on = keys.PERSONAL in requested_terms(msg)
        self.alpha = 0.0
        self.loss = float("nan")
        """The mixed output's loss at the last step."""
        if not self.on:
            return
        config = msg.content.config_records[keys.CONFIG]
        self.lr = float(config[keys.ETA])  # type: ignore[arg-type]
        self.adaptive = bool(config.get(keys.ADAPTIVE_ALPHA, False))
        self.alpha_lr = float(config.get(keys.ALPHA_LR, 0.0)) or self.lr  # type: ignore[arg-type]
        self.alpha = _alpha(context, config)
        self.v = _personal_v(msg, context, model)
        self.v.train()
        self._bufs: list[torch.Tensor | None] = [None] * len(list(self.v.parameters()))
        registry = _PERSONAL.get()
        if registry is not None:
            registry.append(self)

    def step(self, model: nn.Module, x: Any, y: torch.Tensor, loss_fn: Callable[..., torch.Tensor]) -> float:
        """One personal step on ``v_i`` against the current ``model`` (= ``w_i``); returns its loss."""
        if not self.on:
            return float("nan")
        with torch.no_grad():
            h_w = model(x)
        self.loss, self.alpha = personal_step(self.v, h_w, x, y, self.alpha, loss_fn, self.lr,  # type: ignore[arg-type]
                                              self._bufs, self.adaptive, self.alpha_lr)
        _mark(keys.PERSONAL)
        return self.loss

    def commit(self, context: Context, trained: ArrayRecord) -> None:
        """Keep ``v_i``, ``α_i`` and the trained ``w_i`` in ``context.state`` (called by the mod)."""
        context.state[f"{keys.APFL_STATE}.v"] = ArrayRecord(
            {k: Array(t.detach().cpu().numpy().copy()) for k, t in self.v.state_dict().items()})
        context.state[f"{keys.APFL_STATE}.w-local"] = ArrayRecord({k: trained[k] for k in trained.keys()})
        context.state[f"{keys.APFL_STATE}.meta"] = ConfigRecord({"alpha": float(self.alpha)})


def _alpha(context: Context, config: ConfigRecord) -> float:
    meta = context.state.config_records.get(f"{keys.APFL_STATE}.meta")
    return float(meta["alpha"]) if meta is not None else float(config[keys.ALPHA])  # type: ignore[arg-type]


def _load(model: nn.Module, record: ArrayRecord) -> nn.Module:
    out = copy.deepcopy(model)
    out.load_state_dict({k: torch.as_tensor(np.asarray(record[k].numpy()).copy()) for k in record.keys()})
    return out


def _personal_v(msg: Message, context: Context, model: nn.Module) -> nn.Module:
    """``v_i`` from ``context.state``, else the received model (before the client's first round)."""
    kept = context.state.array_records.get(f"{keys.APFL_STATE}.v")
    return _load(model, kept if kept is not None else msg.content.array_records[keys.ARRAYS])


def personal_model(msg: Message, context: Context, model: nn.Module) -> nn.Module:
    """The model an evaluate function evaluates: APFL's personal output, else ``model`` itself.

    With APFL / APFLGate (``apfl-personal`` in the message's config) the module
    ``x ↦ α_i v_i(x) + (1 − α_i) w(x)`` with ``v_i`` and ``α_i`` from ``context.state`` and ``w``
    the client's locally trained copy of its last round (``graphfl.personal-output = local-copy``,
    ALGORITHMS.md §0.1 C6) or the received model ``model`` (``aggregated``); before the client has
    trained, ``v_i`` and ``w`` are the received model. Call it after loading the received
    ``"arrays"`` into ``model``; :func:`graphfl_mod` confirms the call in the reply.
    """
    if keys.PERSONAL not in requested_terms(msg):
        return model
    config = msg.content.config_records[keys.CONFIG]
    state = context.state.array_records
    v = _load(model, state[f"{keys.APFL_STATE}.v"]) if f"{keys.APFL_STATE}.v" in state else model
    local = state.get(f"{keys.APFL_STATE}.w-local")
    use_local = str(config.get(keys.PERSONAL_OUTPUT, "local-copy")) == "local-copy" and local is not None
    w = _load(model, local) if use_local and local is not None else model
    _mark(keys.PERSONAL)
    return OutputMixture(v, w, _alpha(context, config))


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
    """Flower client mod: keeps the client's state across rounds and confirms the client terms.

    * :data:`~graphfl.flower.keys.OWN_MODEL` (local-only training): a message with an empty
      ``"arrays"`` gets the client's own model from ``context.state`` before the ClientApp sees
      it, and a train reply's ``"arrays"`` is stored there as the new own model.
    * :data:`~graphfl.flower.keys.GATE` (FedGATE, APFLGate; ALGORITHMS.md §9.2): before the ClientApp runs,
      ``δ_i ← δ_i + (u_i − ū)/(η τ)`` when the message's ``ū`` (``graphfl.anchor``, round
      ``gate.round``) includes this client's last upload (``gate.accepted``), and ``δ_i`` goes into
      the message as ``graphfl.delta`` for :func:`regulariser`; after it, ``u_i = w − w_i`` of this
      upload is kept for the next round (``context.state``, :data:`~graphfl.flower.keys.GATE_STATE`).
      The kept ``u_i`` is dropped at the next train message either way, as in graphfl's own client.
    * :data:`~graphfl.flower.keys.PERSONAL` (APFL, APFLGate): after a train function that built a
      :class:`Personal`, ``v_i``, ``α_i`` and the trained ``w_i`` (the reply's ``"arrays"``) go
      into ``context.state`` (:data:`~graphfl.flower.keys.APFL_STATE`).
    * Then the ClientApp runs; a reply with a ``"metrics"`` MetricRecord gets
      :data:`~graphfl.flower.keys.APPLIED` = 1 when every requested term (if any) was applied
      during the call (a :func:`regulariser` term evaluated, :meth:`Personal.step` or
      :func:`personal_model` called; else 0), and ``partition-id`` from the node config when the
      reply has none.

    Raises
    ------
    ValueError
        Local-only training asks for the own model before this client stored one (it missed
        round 1); the message says so.
    """
    pid = context.node_config.get(keys.PARTITION_ID)
    terms = requested_terms(msg)
    if keys.OWN_MODEL in terms:
        _put_own_model(msg, context)
    if keys.GATE in terms:
        _gate_before(msg, context)
    token = _APPLIED.set(set())
    personal: list[Personal] = []
    p_token = _PERSONAL.set(personal)
    try:
        reply = call_next(msg, context)
        applied = _APPLIED.get() or set()
    finally:
        _APPLIED.reset(token)
        _PERSONAL.reset(p_token)
    if reply.has_error():
        return reply
    trained = reply.content.array_records.get(keys.ARRAYS)
    if keys.GATE in terms and trained is not None:
        _gate_after(msg, reply, context)
    if keys.PERSONAL in terms and trained is not None and personal:
        personal[-1].commit(context, trained)
    if keys.OWN_MODEL in terms and trained is not None:
        context.state[keys.OWN_STATE] = ArrayRecord({k: trained[k] for k in trained.keys()})
        applied.add(keys.OWN_MODEL)
    metrics_rec = reply.content.metric_records.get(keys.METRICS)
    if metrics_rec is None:
        return reply
    if terms:
        metrics_rec[keys.APPLIED] = 1 if terms <= applied else 0
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
