"""The same ClientApp with graphfl's client parts: the mod, ``regulariser``, ``Personal`` and ``personal_model``.

``regulariser`` is needed by FedProx (mu > 0), FedAMP (prox_mu > 0), FeSEM (prox_lambda > 0), pFedGraph
(lam > 0), FedGATE, APFLGate and BiG-FL; ``Personal`` / ``personal_model`` (APFL's personal model) by APFL
and APFLGate; local-only training (``Local``) needs the mod only (it keeps the client's own model). Each
is a no-op when the strategy asks for nothing.
"""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from graphfl.flower.client import Personal, bigfl_hessian, graphfl_mod, personal_model, regulariser
from graphfl_example.task import load_data, make_model, test, train

app = ClientApp(mods=[graphfl_mod])


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    """As the stock ``train_fn``, with the term the strategy asks for added to the loss."""
    model = make_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y, _, _ = load_data(int(context.node_config["partition-id"]))
    pers = Personal(msg, context, model)            # APFL's personal model (no-op for other strategies)
    loss = train(model, x, y, int(context.run_config["local-steps"]), float(context.run_config["lr"]),
                 extra=regulariser(msg), after_step=lambda m, xb, yb: pers.step(m, xb, yb, nn.functional.mse_loss))
    metrics = MetricRecord({"train_loss": loss, "num-examples": len(x)})
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    hessian = bigfl_hessian(msg, model, nn.functional.mse_loss, x, y)   # BiG-FL's implicit hypergradient only
    if hessian is not None:
        content["graphfl.hessian"] = hessian
    return Message(content, reply_to=msg)


@app.evaluate()
def evaluate_fn(msg: Message, context: Context) -> Message:
    """As the stock ``evaluate_fn``, on APFL's personal output where the strategy asks for it."""
    model = make_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    model = personal_model(msg, context, model)     # the received model itself for other strategies
    _, _, x, y = load_data(int(context.node_config["partition-id"]))
    metrics = MetricRecord({"test_loss": test(model, x, y), "num-examples": len(x)})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
