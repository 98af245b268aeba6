"""A stock ClientApp, written as in Flower's quickstarts: it does not import graphfl."""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from graphfl_example.task import load_data, make_model, test, train

app = ClientApp()


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    """Train the received model on this node's partition; reply with the model and ``num-examples``."""
    model = make_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y, _, _ = load_data(int(context.node_config["partition-id"]))
    loss = train(model, x, y, int(context.run_config["local-steps"]), float(context.run_config["lr"]))
    metrics = MetricRecord({"train_loss": loss, "num-examples": len(x)})
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)


@app.evaluate()
def evaluate_fn(msg: Message, context: Context) -> Message:
    """Test MSE of the received model on this node's test split."""
    model = make_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    _, _, x, y = load_data(int(context.node_config["partition-id"]))
    metrics = MetricRecord({"test_loss": test(model, x, y), "num-examples": len(x)})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
