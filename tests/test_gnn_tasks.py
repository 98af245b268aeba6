"""GNN tasks ``bbbp`` (molecules, ROC-AUC) and ``ciao`` (user–item ratings, MAE).

Graph construction is checked on molecules whose atom and bond counts are known by hand; the
loaders on tiny fixture files written here; the real files in ../shared/data through the
``real_data`` fixture (skipped with the reason outside CI, failed under ``CI=true``).
"""

import logging

import numpy as np
import pytest
import torch

from graphfl.client.training import evaluate_client, get_arrays, set_arrays, sgd_steps
from graphfl.common.config import ConfigError, DataConfig, parse_run_config
from graphfl.tasks import registry
from graphfl.tasks.base import DataError
from graphfl.tasks.ciao import NUM_USERS, read_ratings
from graphfl.tasks.molecules import read_molecules, roc_auc, scaffold_split, smiles_graph

# --------------------------------------------------------------------------- SMILES -> graphs


@pytest.mark.parametrize("smiles, atoms, bonds", [
    ("CCO", 3, 2),                    # ethanol: C-C-O
    ("c1ccccc1", 6, 6),               # benzene ring
    ("CC(=O)Oc1ccccc1C(=O)O", 13, 13),  # aspirin: 9 C + 4 O heavy atoms, one ring closure
    ("[Na+].[Cl-]", 2, 0),            # two ions, no bond
])
def test_smiles_graph_atom_and_bond_counts(smiles, atoms, bonds):
    g = smiles_graph(smiles)
    assert g.num_nodes == atoms and g.x.shape == (atoms, 9)
    assert g.edge_index.shape == (2, 2 * bonds)          # every bond as two directed edges
    src, dst = g.edge_index.tolist()
    assert sorted(zip(src, dst)) == sorted(zip(dst, src))  # symmetric


def test_smiles_graph_features_name_the_atoms():
    g = smiles_graph("CCO")
    assert g.x[:, 0].tolist() == [6, 6, 8]              # atomic numbers
    assert sorted(map(tuple, g.edge_index.t().tolist())) == [(0, 1), (1, 0), (1, 2), (2, 1)]


def test_unparsable_smiles():
    assert smiles_graph("N(=O)(=O)(=O)C") is None        # pentavalent N: RDKit rejects it


def write_csv(path, rows):
    lines = ["num,name,p_np,smiles"] + [f"{i + 1},mol{i},{y},{s}" for i, (s, y) in enumerate(rows)]
    path.write_text("\r\n".join(lines) + "\r\n")
    return path


TEN = [("CCO", 1), ("c1ccccc1C", 1), ("c1ccccc1CC", 0), ("N(=O)(=O)(=O)C", 1), ("C1CCCCC1O", 0),
       ("c1ccncc1", 1), ("CC(=O)Oc1ccccc1C(=O)O", 0), ("C1CCCCC1N", 1), ("c1ccccc1O", 0), ("CCCCN", 1)]


def test_reader_skips_and_reports_the_unparsable_row(tmp_path, caplog):
    path = write_csv(tmp_path / "BBBP.csv", TEN)
    with caplog.at_level(logging.WARNING, logger="graphfl.tasks.molecules"):
        mols = read_molecules(path)
    assert len(mols.graphs) == 9 and mols.labels.tolist() == [1, 1, 0, 0, 1, 0, 1, 0, 1]
    assert mols.skipped == ((5, "N(=O)(=O)(=O)C"),)     # CSV line 5 (header is line 1)
    assert 5 not in mols.rows.tolist() and mols.rows[:4].tolist() == [2, 3, 4, 6]
    assert any("line 5" in r.getMessage() and "N(=O)(=O)(=O)C" in r.getMessage() for r in caplog.records)
    assert mols.scaffolds[1] == mols.scaffolds[2] == "c1ccccc1"   # toluene and ethylbenzene
    assert mols.scaffolds[0] == ""                                 # acyclic


def test_reader_bad_label_and_missing_column_name_the_problem(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("num,name,p_np,smiles\n1,a,1,CCO\n2,b,yes,CCN\n")
    with pytest.raises(DataError, match=r"line 3.*'yes'"):
        read_molecules(bad)
    nocol = tmp_path / "nocol.csv"
    nocol.write_text("num,name,label,smiles\n1,a,1,CCO\n")
    with pytest.raises(DataError, match="missing column.*p_np"):
        read_molecules(nocol)
    with pytest.raises(DataError, match="missing file"):
        read_molecules(tmp_path / "absent.csv")


def test_scaffold_split_keeps_each_scaffold_on_one_side():
    scaffolds = ["A"] * 5 + ["B"] * 3 + ["C"] * 2 + ["D", "E", "F"] + ["B"] + ["G"] * 2
    test = scaffold_split(scaffolds, 0.25)
    for s in set(scaffolds):
        sides = {bool(test[i]) for i, t in enumerate(scaffolds) if t == s}
        assert len(sides) == 1, s
    # by hand: groups by (size, first index) descending: A5, B4, G2(14), C2(8), F1, E1, D1; cutoff 0.75 * 17 = 12.75
    # train takes A (5), B (9); G would make 11 <= 12.75 -> train; C -> 13 > 12.75 -> test; F -> 12 -> train; E, D test
    expect_test = {"C", "E", "D"}
    assert {s for i, s in enumerate(scaffolds) if test[i]} == expect_test


def test_roc_auc_by_hand_and_single_class_is_nan():
    logits = np.array([[0, 0.1], [0, 0.4], [0, 0.35], [0, 0.8]])
    # scores 0.1, 0.4, 0.35, 0.8 for labels 0, 0, 1, 1: positive pairs ranked above: (0.35>0.1), (0.8>both) = 3 of 4
    assert roc_auc(logits, np.array([0, 0, 1, 1])) == pytest.approx(0.75)
    assert np.isnan(roc_auc(logits, np.array([1, 1, 1, 1])))
    assert np.isnan(roc_auc(np.zeros((0, 2)), np.array([], np.int64)))


def bbbp_task(tmp_path, rows=TEN, **data):
    (tmp_path / "bbbp").mkdir(exist_ok=True)
    write_csv(tmp_path / "bbbp" / "BBBP.csv", rows)
    cfg = DataConfig(**{"min_partition_size": 1, **data})
    return registry.create("bbbp", data=cfg, data_dir=str(tmp_path), seed=0)


def test_bbbp_fixture_clients_batch_train_and_evaluate(tmp_path):
    task = bbbp_task(tmp_path, test_fraction=0.3)
    parts = [task.client_data(pid, 2) for pid in range(2)]
    ids = np.concatenate([np.concatenate([d.x_train, d.x_test]) for d in parts])
    assert sorted(ids.tolist()) == list(range(9))        # every parsed molecule once
    mols = task.molecules()
    test_scaffolds = {mols.scaffolds[i] for d in parts for i in d.x_test}
    train_scaffolds = {mols.scaffolds[i] for d in parts for i in d.x_train}
    assert not test_scaffolds & train_scaffolds          # scaffold split: no test scaffold in training
    assert task.describe()["skipped_unparsable"] == 1 and task.describe()["skipped_rows"] == [5]
    d = parts[0]
    batch = d.collate(d.x_train[:3])
    assert batch.num_graphs == 3
    assert batch.num_nodes == sum(mols.graphs[i].num_nodes for i in d.x_train[:3])
    model = task.build_model()
    assert model(batch).shape == (3, 2)
    before = get_arrays(model)
    loss = sgd_steps(model, d, task.loss_fn(), steps=3, batch_size=4, lr=0.05, rng=np.random.default_rng(0))
    assert np.isfinite(loss)
    assert any(not np.array_equal(before[k], v) for k, v in get_arrays(model).items())
    other = task.build_model()
    set_arrays(other, get_arrays(model))                 # the state dict is the wire format
    out = evaluate_client(other, task, d, task.loss_fn())
    assert set(out) >= {"test_loss", "test_acc", "test_auc", "num_test"}


def test_bbbp_random_split_and_bad_split_name(tmp_path):
    task = bbbp_task(tmp_path, split="random", test_fraction=0.3)
    assert task.split == "random"
    d = task.client_data(0, 1)
    assert len(d.x_train) + len(d.x_test) == 9 and len(d.x_test) == 3
    with pytest.raises(ConfigError, match="data.split"):
        parse_run_config({"data.split": "murcko"})


def test_bbbp_missing_file_names_it(tmp_path):
    task = registry.create("bbbp", data_dir=str(tmp_path))
    with pytest.raises(DataError, match=r"bbbp.*BBBP.csv"):
        task.client_data(0, 2)


# --------------------------------------------------------------------------- ciao


def write_mat(path, rows):
    from scipy.io import savemat

    path.parent.mkdir(parents=True, exist_ok=True)
    savemat(str(path), {"rating": np.asarray(rows, np.int32)})
    return path


# userid, productid, categoryid, rating, helpfulness
CIAO_ROWS = [
    [1, 10, 1, 5, 3], [2, 10, 1, 4, 3], [3, 11, 1, 2, 3], [1, 11, 1, 3, 3], [2, 12, 1, 5, 3],
    [3, 12, 1, 0, 3],                                    # zero rating: dropped
    [1, 10, 1, 1, 3],                                    # repeated (user 1, product 10, cat 1): dropped
    [4, 20, 2, 4, 3], [5, 20, 2, 5, 3], [4, 21, 2, 3, 3], [6, 21, 2, 2, 3],
    [1, 30, 3, 4, 3], [6, 30, 3, 5, 3], [7, 31, 3, 1, 3],
]


def test_ciao_reader_cleans_ratings(tmp_path):
    r = read_ratings(write_mat(tmp_path / "rating.mat", CIAO_ROWS))
    assert r.dropped_zero == 1 and r.dropped_duplicate == 1 and len(r.rating) == 12
    assert r.user[0] == 0 and r.item[0] == 10 and r.rating[0] == 5.0   # users 0-based, first row kept
    with pytest.raises(DataError, match="userid = 9999"):
        read_ratings(write_mat(tmp_path / "bad.mat", [[9999, 1, 1, 3, 1]]))
    with pytest.raises(DataError, match="categoryid = 29"):
        read_ratings(write_mat(tmp_path / "bad2.mat", [[1, 1, 29, 3, 1]]))


def test_ciao_one_client_per_category_graph_and_training(tmp_path):
    write_mat(tmp_path / "ciao" / "rating.mat", CIAO_ROWS)
    task = registry.create("ciao", data=DataConfig(test_fraction=0.25), data_dir=str(tmp_path), seed=0)
    with pytest.raises(DataError, match="at most 28 clients"):
        task.client_data(0, 29)
    d = task.client_data(0, 28)                          # category 1: 5 ratings after cleaning
    assert d.num_train + d.num_test == 5 and d.num_test == 1
    users = np.concatenate([d.x_train[:, 0], d.x_test[:, 0]])
    assert sorted(set(users.tolist())) == [0, 1, 2]      # users 1..3 of category 1, 0-based
    batch = d.collate(d.x_train)
    assert batch.num_nodes == 3 + 3                      # the client's users 1..3 + products 10, 11, 12
    assert batch.user_ids.tolist() == [0, 1, 2]          # their rows of the shared user table
    nodes = 3 + 3
    assert batch.edge_index.shape == (2, 2 * d.num_train + nodes)  # training ratings both ways + self loops
    a = torch.zeros(nodes, nodes)
    a[batch.edge_index[0], batch.edge_index[1]] = batch.edge_weight
    deg = (a > 0).sum(0).float()                           # degree counting the self loop
    i, j = batch.edge_index[:, 0].tolist()
    assert float(a[i, j]) == pytest.approx(1.0 / float(torch.sqrt(deg[i] * deg[j])))  # D^-1/2 (A+I) D^-1/2
    assert int(batch.pairs[:, 1].min()) >= 3
    grouped = registry.create("ciao", data=DataConfig(test_fraction=0.25), data_dir=str(tmp_path)).client_data(0, 2)
    assert grouped.num_train + grouped.num_test == 5 + 3  # categories 1 and 3 on client 0 of 2
    model = task.build_model()
    pred = model(batch)
    assert pred.shape == (d.num_train,)
    loss = sgd_steps(model, d, task.loss_fn(), steps=20, batch_size=4, lr=0.05, rng=np.random.default_rng(0))
    assert np.isfinite(loss)
    out = evaluate_client(model, task, d, task.loss_fn())
    with torch.no_grad():
        by_hand = float(np.abs(model(d.collate(d.x_test)).numpy() - d.y_test).mean())
    assert out["test_mae"] == pytest.approx(by_hand, rel=1e-5)
    assert "test_acc" not in out


# --------------------------------------------------------------------------- the real files


def test_real_bbbp_parses_2039_molecules(real_data, caplog):
    root = real_data("bbbp/BBBP.csv")
    task = registry.create("bbbp", data_dir=str(root), seed=0)
    info = task.describe()
    assert info["molecules"] == 2039 and info["skipped_unparsable"] == 11    # README: 11 rows RDKit rejects
    assert info["test_molecules"] == pytest.approx(0.2 * 2039, abs=5)
    labels = task.molecules().labels
    assert np.bincount(labels).tolist() == [479, 1560]                        # 483 / 1567 less the skipped
    d = task.client_data(0, 16)
    assert d.num_train > 0 and set(np.unique(d.y_train)) <= {0, 1}


def test_real_ciao_has_28_categories(real_data):
    root = real_data("ciao/rating.mat")
    task = registry.create("ciao", data_dir=str(root), seed=0)
    r = task.ratings()
    assert r.dropped_zero == 34 and len(np.unique(r.category)) == 28
    assert int(r.user.max()) == NUM_USERS - 1
    sizes = [task.client_data(pid, 28).num_train + task.client_data(pid, 28).num_test for pid in (0, 25)]
    assert sizes[0] > 39000 and sizes[1] <= 68                                # README: 39,887 and 68 ratings


def test_fedavg_on_a_small_real_bbbp_subset_learns(real_data, tmp_path):
    from graphfl.server.inprocess import run_federated_inprocess

    root = real_data("bbbp/BBBP.csv")
    (tmp_path / "bbbp").mkdir()
    lines = (root / "bbbp" / "BBBP.csv").read_text().splitlines()
    # rows 1..400 hold both classes (the file's second half is all positive)
    (tmp_path / "bbbp" / "BBBP.csv").write_text("\n".join(lines[:401]) + "\n")
    # 2 clients, near-iid labels (α = 10) so that both hold both classes; with α = 0.5 and 4 clients on
    # 397 molecules the clients' test sets are nearly one-class and ROC-AUC is mostly undefined
    cfg = parse_run_config({"strategy": "fedavg", "task": "bbbp", "nodes": 2, "rounds": 2, "engine": "inprocess",
                            "data-dir": str(tmp_path), "data.split": "random", "data.dirichlet-alpha": 10.0,
                            "device": "cpu", "train.local-steps": 30, "train.lr": 0.05})
    doc, _ = run_federated_inprocess(cfg)
    curve = doc["methods"]["fedavg"]["curve"]
    assert doc["task"]["molecules"] == 397 and doc["task"]["skipped_rows"] == [61, 63, 393]
    assert curve[2]["train_loss"] < curve[1]["train_loss"]
    assert curve[-1]["test_loss"] < curve[0]["test_loss"]
    assert curve[-1]["test_auc"] > max(0.5, curve[0]["test_auc"])
    assert set(curve[-1]["test_auc_per_client"]) == {"0", "1"}
    assert doc["methods"]["fedavg"]["final"]["test_auc"] == curve[-1]["test_auc"]


def test_ciao_client_subgraph_equals_the_graph_over_all_users(tmp_path):
    """Leaving out users without a rating in the client's categories changes neither the
    predictions nor the gradient of the shared user table (they are isolated nodes)."""
    from torch_geometric.data import Data

    write_mat(tmp_path / "ciao" / "rating.mat", CIAO_ROWS)
    task = registry.create("ciao", data=DataConfig(test_fraction=0.25), data_dir=str(tmp_path), seed=0)
    d = task.client_data(2, 28)                          # category 3: users 1, 6, 7 (0-based 0, 5, 6)
    small = d.collate(d.x_test)
    assert small.user_ids.tolist() == [0, 5, 6] and small.num_nodes == 3 + 2
    # the same graph over all NUM_USERS users, built by hand: user u is node u, item k is node NUM_USERS + k
    from graphfl.tasks.gnn_models import gcn_norm_edges

    tr = d.collate(d.x_train)
    to_global = torch.cat([small.user_ids, torch.arange(2) + NUM_USERS])
    undirected = tr.edge_index[:, tr.edge_index[0] != tr.edge_index[1]]   # drop the self loops
    ei, w = gcn_norm_edges(to_global[undirected], NUM_USERS + 2)
    pairs = to_global[small.pairs]
    full = Data(edge_index=ei, edge_weight=w, item_feat=small.item_feat, pairs=pairs, num_nodes=NUM_USERS + 2)
    model = task.build_model()
    y = torch.as_tensor(d.y_test)
    outs, grads = [], []
    for batch in (small, full):
        model.zero_grad()
        pred = model(batch)
        ((pred - y) ** 2).mean().backward()
        outs.append(pred.detach())
        grads.append(model.users.weight.grad.clone())
    assert torch.allclose(outs[0], outs[1], atol=1e-6)
    assert torch.allclose(grads[0], grads[1], atol=1e-7) and float(grads[0].abs().sum()) > 0
    with pytest.raises(ValueError, match="user id 1 is not one of this client"):
        d.collate(np.array([[1, 0]]))


def test_ciao_validation_view_builds_its_graph_without_the_held_out_ratings(tmp_path):
    """Tuning on ``ciao+val`` must not see the validation ratings as graph edges (label leak)."""
    from graphfl.tasks.holdout import validation_task

    write_mat(tmp_path / "ciao" / "rating.mat", CIAO_ROWS)
    val = registry.create(validation_task("ciao"), data=DataConfig(test_fraction=0.25), data_dir=str(tmp_path))
    full = registry.create("ciao", data=DataConfig(test_fraction=0.25), data_dir=str(tmp_path)).client_data(0, 28)
    d = val.client_data(0, 28)                           # category 1: 4 training ratings, 1 of them held out
    assert d.num_train + d.num_test == full.num_train and d.num_test >= 1
    b = d.collate(d.x_test)
    undirected = b.edge_index[:, b.edge_index[0] != b.edge_index[1]]
    assert undirected.shape[1] == 2 * d.num_train                        # only the remaining training ratings
    edges = {tuple(e) for e in undirected.t().tolist()}
    for u, i in b.pairs.tolist():
        assert (u, i) not in edges                                        # no validation pair is an edge
