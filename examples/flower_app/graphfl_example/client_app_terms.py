"""The same ClientApp with graphfl's client term: two added lines (the mod and ``regulariser``).

Needed by FedProx (mu > 0), FedAMP (prox_mu > 0), FeSEM (prox_lambda > 0), pFedGraph (lam > 0) and FedGATE;
local-only training (``Local``) needs the mod only (it keeps the client's own model).
"""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from graphfl.flower.client import graphfl_mod, regulariser
from graphfl_example.client_app import evaluate_fn
from graphfl_example.task import load_data, make_model, train

app = ClientApp(mods=[graphfl_mod])
app.evaluate()(evaluate_fn)


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    """As the stock ``train_fn``, with the term the strategy asks for added to the loss."""
    model = make_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y, _, _ = load_data(int(context.node_config["partition-id"]))
    loss = train(model, x, y, int(context.run_config["local-steps"]), float(context.run_config["lr"]),
                 extra=regulariser(msg))
    metrics = MetricRecord({"train_loss": loss, "num-examples": len(x)})
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)
