"""``stacked_forward``: every client's own output, through batched matrix products for an MLP and
through ``vmap(functional_call)`` for any other model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from graphfl.client.batched import _layer_plan, stacked_forward
from graphfl.tasks.models import CNN, MLP, multicenter_net


@pytest.mark.parametrize("build", [multicenter_net, lambda: MLP(12, (7, 5), 3), lambda: CNN(1, 8, 4, 2, 3, 6),
                                   lambda: nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))],
                         ids=["multicenter", "mlp-relu-bias", "cnn", "sequential"])
def test_each_clients_output_is_its_own_models_output(build):
    torch.manual_seed(0)
    models = [build() for _ in range(3)]
    keys = [k for k, _ in models[0].named_parameters()]
    params = {k: torch.stack([dict(m.named_parameters())[k].detach() for m in models]) for k in keys}
    sample = next(models[0].parameters())
    if isinstance(models[0], CNN):
        x = torch.randn(3, 5, 1, 8, 8)
    else:
        x = torch.randn(3, 5, models[0].net[0].in_features if isinstance(models[0], MLP) else sample.shape[1])
    out = stacked_forward(models[0])(params, x)
    for i, m in enumerate(models):
        with torch.no_grad():
            np.testing.assert_allclose(out[i].detach().numpy(), m(x[i]).numpy(), rtol=1e-5, atol=1e-6)
    assert (_layer_plan(models[0]) is None) == isinstance(models[0], CNN)   # the CNN takes the vmap path
