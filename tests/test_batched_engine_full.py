"""The batched engine's convolutional path and the full-form engine bench's growth and profile."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from graphfl.bench import engine
from graphfl.client.batched import PROFILE_LABELS, _per_client_forward, stacked_forward
from graphfl.tasks.models import CNN, MLP


def test_a_cpu_cnn_forwards_client_by_client_with_each_clients_own_gradient():
    torch.manual_seed(0)
    models = [CNN(1, 8, 4, 2, 3, 6) for _ in range(3)]
    assert _per_client_forward(models[0]) and not _per_client_forward(MLP(4, (3,), 2))
    keys = [k for k, _ in models[0].named_parameters()]
    params = {k: torch.stack([dict(m.named_parameters())[k].detach() for m in models]).requires_grad_()
              for k in keys}
    x, y = torch.randn(3, 5, 1, 8, 8), torch.randint(0, 3, (3, 5))
    out = stacked_forward(models[0])(params, x)
    sum(nn.functional.cross_entropy(out[i], y[i]) for i in range(3)).backward()
    for i, m in enumerate(models):
        nn.functional.cross_entropy(m(x[i]), y[i]).backward()
        for k, p in m.named_parameters():
            assert p.grad is not None
            np.testing.assert_allclose(params[k].grad[i].numpy(), p.grad.numpy(), rtol=1e-5, atol=1e-7)


class _Bilinear(nn.Module):      # neither a Linear stack nor convolutional: the vmap path
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.a) * 2.0


def test_other_models_still_take_the_vmap_path_with_their_own_outputs():
    torch.manual_seed(1)
    models = [_Bilinear() for _ in range(2)]
    assert not _per_client_forward(models[0])
    params = {"a": torch.stack([m.a.detach() for m in models])}
    x = torch.randn(2, 5, 4)
    out = stacked_forward(models[0])(params, x)
    for i, m in enumerate(models):
        with torch.no_grad():
            np.testing.assert_allclose(out[i].numpy(), m(x[i]).numpy(), rtol=1e-6)


def _row(clients: int, engine_name: str, round_s: float, setup_s: float) -> dict:
    return {"task": "t", "clients": clients, "engine": engine_name, "round_s": round_s, "setup_s": setup_s}


def test_growth_exponents_and_the_sentence_come_from_the_rows():
    rows = [_row(10, "batched", 0.1, 1.0), _row(100, "batched", 0.1, 10.0), _row(1000, "batched", 1.0, 1000.0),
            _row(10, "inprocess", 1.0, 1.0), _row(100, "inprocess", 10.0, 10.0)]
    steps = engine.scaling(rows)
    by = {(s["engine"], s["from"]): s for s in steps}
    assert math.isclose(by[("batched", 10)]["round_s_exponent"], 0.0, abs_tol=1e-12)
    assert math.isclose(by[("batched", 100)]["round_s_exponent"], 1.0)
    assert math.isclose(by[("batched", 100)]["setup_s_exponent"], 2.0)
    text = dict(zip(["batched", "inprocess"], engine.scaling_sentences(steps)))
    assert "round time 10→100: sub-linear (exponent 0.00)" in text["batched"]
    assert "not linear from 10 to 100 clients" in text["batched"]          # round time
    assert "not linear from 100 to 1000 clients" in text["batched"]        # set-up
    assert text["inprocess"].count("linear throughout") == 2
    doc = engine._doc(False, 0, rows, {"cpus": 2}, 1.0)
    assert doc["rows"][0]["round_s_per_client"] == 0.01 and doc["scaling_summary"] == engine.scaling_sentences(steps)


def test_the_profile_of_a_real_batched_round_names_its_parts(tmp_path):
    prof = engine.profile_round({"task": "synthetic-multicenter", "clients": 4, "engine": "batched", "rounds": 2}, 0)
    assert "error" not in prof, prof
    for part in ("forward", "backward", "optimizer", "gather", "evaluate", "other"):
        assert prof["seconds"][part] >= 0 and part in prof["share"]
    assert prof["calls"]["forward"] == engine.LOCAL_STEPS          # one chunk, one call per local step
    assert sum(prof["seconds"].values()) <= prof["round_s"] * 1.05 + 1e-3
    assert set(prof["calls"]) <= set(PROFILE_LABELS)
    doc = engine._doc(False, 0, [], {"cpus": 2}, 1.0, prof)
    assert doc["profile_summary"].startswith("One batched round of synthetic-multicenter at 4 clients")
    engine.write(tmp_path, doc, plot=False)
    assert "## Where the time goes" in (tmp_path / "engine.md").read_text()


def test_the_reproduction_benches_run_batched_with_the_in_process_engines_numbers(monkeypatch):
    from graphfl.bench import apflgate
    from graphfl.bench import jgesr as bj

    assert apflgate.ENGINE == bj.ENGINE == "batched"
    form = bj.Form(**{**bj.QUICK.__dict__, "nodes": 4, "rounds": 2, "local_steps": 2})
    batched = bj.run_one("FedProx", "digits", form, 0, 0.05, 0.5, 0.0)
    monkeypatch.setattr(bj, "ENGINE", "inprocess")
    inproc = bj.run_one("FedProx", "digits", form, 0, 0.05, 0.5, 0.0)
    assert batched["engine"]["engine"] == "batched" and "batch_chunk" in batched["engine"]
    assert inproc["engine"] == {"engine": "inprocess"}
    np.testing.assert_allclose(batched["acc"], inproc["acc"], rtol=1e-6, atol=1e-9)
    key = apflgate.run_key("apfl", "digits", 4, apflgate.QUICK, 0, 0.1, {}, "")
    assert key["engine"] == "batched"           # an in-process run's cache entry is not reused
