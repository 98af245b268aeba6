"""Message keys shared by graphfl's Flower-native strategies and their client helpers.

A Flower-native graphfl strategy speaks Flower's quickstart conventions: the model travels as
the ``ArrayRecord`` ``"arrays"`` (each client gets its own), the server's scalars as the
``ConfigRecord`` ``"config"`` and a reply carries ``"arrays"`` plus a ``MetricRecord``
``"metrics"`` with ``"num-examples"``. What an algorithm needs beyond that travels under the
names below; a stock ClientApp ignores them.
"""

from __future__ import annotations

ARRAYS = "arrays"
"""ArrayRecord of the model (server -> client: the client's own model; reply: the trained model)."""
CONFIG = "config"
"""ConfigRecord of the message (Flower's ``train_config`` / ``evaluate_config`` plus the keys below)."""
METRICS = "metrics"
"""MetricRecord of a reply."""
NUM_EXAMPLES = "num-examples"
"""Reply metric: the client's number of training (train reply) or test (evaluate reply) examples."""
PARTITION_ID = "partition-id"
"""Reply metric (optional): the client's partition id; the strategy then addresses it by it."""
SERVER_ROUND = "server-round"
"""Config key: the current round (as Flower's own strategies send it)."""

REGULARISER = "graphfl.regulariser"
"""Config key: the client term the strategy needs in the local loss (:data:`PROXIMAL`,
:data:`COSINE`); absent when the algorithm needs nothing from the client."""
MU = "graphfl.mu"
"""Config key: ``μ`` of the proximal term ``μ/2 ‖θ − θ_received‖²``."""
LAM = "graphfl.lam"
"""Config key: ``λ`` of pFedGraph's similarity term ``−λ ⟨c, θ⟩/‖θ‖``."""
ANCHOR = "graphfl.anchor"
"""ArrayRecord of arrays the client term reads: pFedGraph's cluster model ``c`` and FedGATE's /
APFLGate's mean update ``ū`` of the last round (model keys); BiG-FL's message ``m_i``
(``bigfl/m``, ``d``) and ``φ`` (``bigfl/phi``, ``d×d``)."""
ETA = "graphfl.eta"
"""Config key: the client's SGD step ``η`` in FedGATE's δ update."""
TAU = "graphfl.tau"
"""Config key: ``τ`` of FedGATE's δ update ``δ_i += (u_i − ū)/(η τ)``."""
DELTA = "graphfl.delta"
"""ArrayRecord that :func:`graphfl.flower.client.graphfl_mod` puts into a FedGATE train message:
the client's tracking variable ``δ_i`` (read by :func:`graphfl.flower.client.regulariser`)."""
GATE_STATE = "graphfl.gate"
"""Prefix of FedGATE's records in the ClientApp's ``context.state``: ``graphfl.gate.delta``
(``δ_i``), ``graphfl.gate.up`` (``u_i`` of the last upload) and ``graphfl.gate.meta`` (its round)."""
KAPPA = "graphfl.kappa"
"""Config key: ``κ`` of BiG-FL's lower-level ridge ``(κ/2)‖θ − c_i‖²``."""
RIDGE = "graphfl.ridge"
"""Config key (string): BiG-FL's ridge centre ``c_i``: ``proximal`` (the received model) or ``origin`` (0)."""
THETA_KEYS = "graphfl.theta-keys"
"""Config key (list of strings): the parameters whose concatenation is BiG-FL's ``θ`` (in order)."""
ALPHA = "graphfl.alpha"
"""Config key: APFL's initial mixing weight ``α_i`` (the client keeps its own after round 1)."""
ADAPTIVE_ALPHA = "graphfl.adaptive-alpha"
"""Config key (bool): update ``α_i`` by gradient descent every local step (APFL)."""
ALPHA_LR = "graphfl.alpha-lr"
"""Config key: step ``η_α`` of the α update."""
PERSONAL_OUTPUT = "graphfl.personal-output"
"""Config key (string): which copy of ``w`` APFL's personal output mixes with: ``local-copy`` (the
client's locally trained ``w_i`` of its last round) or ``aggregated`` (the received ``w``)."""
APFL_STATE = "graphfl.apfl"
"""Prefix of APFL's records in the ClientApp's ``context.state``: ``graphfl.apfl.v`` (the personal
model ``v_i``), ``graphfl.apfl.w-local`` (the locally trained ``w_i`` of the last round) and
``graphfl.apfl.meta`` (``alpha``)."""
HESSIAN = "graphfl.hessian"
"""ArrayRecord of a BiG-FL train reply when the config's ``bigfl.hessian`` asks for it (``implicit``
hypergradient): ``bigfl/hessian``, the ``d×d`` Hessian of the client's data loss in ``θ`` at the
trained model (:func:`graphfl.flower.client.bigfl_hessian`)."""
APPLIED = "graphfl.applied"
"""Reply metric set by :func:`graphfl.flower.client.graphfl_mod`: 1 when the train function
added the requested regulariser to its loss, 0 when it did not."""
OWN_MODEL = "own-model"
"""Client term of local-only training: the client trains and is evaluated on its own model, which
:func:`graphfl.flower.client.graphfl_mod` keeps in ``context.state`` (:data:`OWN_STATE`) and puts
into ``"arrays"`` when the server sends none."""
OWN_STATE = "graphfl.own-model"
"""ArrayRecord in the ClientApp's ``context.state``: the client's own model (local-only training)."""

GATE = "gate-delta"
"""Regulariser ``−Σ_k ⟨δ_k, θ_k⟩`` (FedGATE's correction: the step becomes ``θ ← θ − η(∇ℓ − δ)``),
with ``δ`` kept and updated by :func:`graphfl.flower.client.graphfl_mod`."""
PROXIMAL = "proximal"
"""Regulariser ``μ/2 ‖θ − θ_received‖²`` over the model's parameters (FedProx, FedAMP, FeSEM)."""
BIGFL = "bigfl-ll"
"""Regulariser ``(λ/2)‖m_i + â_i θ φ − θ‖² + (κ/2)‖θ − c_i‖²``: BiG-FL's lower-level term (seed 000
eq. 10.17; :func:`graphfl.strategies.bigfl_math.ll_reg_loss`), ``m_i`` and ``φ`` in :data:`ANCHOR`."""
PERSONAL = "apfl-personal"
"""Client term of APFL: the personal model ``v_i`` trained on the mixed output
``α_i h(v_i) + (1 − α_i) h(w_i)`` (:class:`graphfl.flower.client.Personal`) and evaluated through
:func:`graphfl.flower.client.personal_model`. APFLGate asks for ``gate-delta+apfl-personal``."""
TERM_SEP = "+"
""":data:`REGULARISER` may name several terms joined by this separator (APFLGate)."""
COSINE = "pfedgraph-cosine"
"""Regulariser ``−λ ⟨c, θ⟩/‖θ‖`` with ``c`` in :data:`ANCHOR` (pFedGraph)."""
