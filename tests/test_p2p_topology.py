"""Topology generators, network files and mixing rules, against hand-computed matrices."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from graphfl.common.config import ConfigError
from graphfl.p2p.mixing import mix, mixing_matrix, reweight, validate_mixing
from graphfl.p2p.topology import generate_graph, load_topology, make_topology

T = 1.0 / 3.0


def adj_from_edges(n, edges):
    a = np.zeros((n, n))
    for i, j, *w in edges:
        a[i, j] = a[j, i] = w[0] if w else 1.0
    return a


RING4 = adj_from_edges(4, [(0, 1), (1, 2), (2, 3), (0, 3)])
PATH3 = adj_from_edges(3, [(0, 1), (1, 2)])
STAR4 = adj_from_edges(4, [(0, 1), (0, 2), (0, 3)])


def test_metropolis_ring_path_star():
    np.testing.assert_allclose(
        mixing_matrix(RING4), [[T, T, 0, T], [T, T, T, 0], [0, T, T, T], [T, 0, T, T]], atol=1e-15
    )
    np.testing.assert_allclose(mixing_matrix(PATH3), [[2 * T, T, 0], [T, T, T], [0, T, 2 * T]], atol=1e-15)
    q = 0.25
    np.testing.assert_allclose(
        mixing_matrix(STAR4), [[q, q, q, q], [q, 3 * q, 0, 0], [q, 0, 3 * q, 0], [q, 0, 0, 3 * q]], atol=1e-15
    )


def test_max_degree_variants_on_star():
    q = 0.25
    np.testing.assert_allclose(
        mixing_matrix(STAR4, "max-degree"), [[q, q, q, q], [q, 3 * q, 0, 0], [q, 0, 3 * q, 0], [q, 0, 0, 3 * q]]
    )
    np.testing.assert_allclose(
        mixing_matrix(STAR4, "max-degree", variant="dmax"),
        [[0, T, T, T], [T, 2 * T, 0, 0], [T, 0, 2 * T, 0], [T, 0, 0, 2 * T]],
        atol=1e-15,
    )
    np.testing.assert_allclose(mixing_matrix(PATH3, "max-degree", variant="n"), mixing_matrix(PATH3, "max-degree"))
    with pytest.raises(ConfigError, match="variant"):
        mixing_matrix(STAR4, "max-degree", variant="bogus")


def test_laplacian_weighted_and_best_epsilon():
    a = adj_from_edges(3, [(0, 1, 2.0), (1, 2, 1.0)])
    # weighted degrees 2, 3, 1 -> eps = 1/4
    np.testing.assert_allclose(mixing_matrix(a, "laplacian"), [[0.5, 0.5, 0], [0.5, 0.25, 0.25], [0, 0.25, 0.75]])
    # ring C4: Laplacian eigenvalues 0, 2, 2, 4 -> eps* = 2/(2+4) = 1/3
    np.testing.assert_allclose(mixing_matrix(RING4, "laplacian", epsilon="best"), mixing_matrix(RING4), atol=1e-12)
    with pytest.raises(ConfigError, match="negative"):
        mixing_matrix(STAR4, "laplacian", epsilon=0.9)


def test_unknown_rule_lists_choices():
    with pytest.raises(ConfigError, match="metropolis"):
        mixing_matrix(RING4, "uniform")


def test_validation_errors():
    w = mixing_matrix(RING4)
    bad = w.copy()
    bad[0, 1] += 1e-9
    with pytest.raises(ConfigError, match="symmetric"):
        validate_mixing(bad)
    bad = w.copy() * 1.001
    with pytest.raises(ConfigError, match="row 0"):
        validate_mixing(bad)
    neg = np.array([[1.5, -0.5], [-0.5, 1.5]])
    with pytest.raises(ConfigError, match="negative"):
        validate_mixing(neg)
    with pytest.raises(ConfigError, match="not an edge"):
        validate_mixing(np.full((3, 3), T), adj=PATH3)
    with pytest.raises(ConfigError, match="symmetric"):
        mixing_matrix(np.array([[0, 1.0], [0, 0]]))


def test_disconnected_warns_and_isolated_peer_keeps_itself(caplog):
    a = adj_from_edges(4, [(0, 1)])  # 2 and 3 isolated
    with caplog.at_level(logging.WARNING, logger="graphfl.p2p.mixing"):
        w = mixing_matrix(a)
    assert "disconnected" in caplog.text
    assert w[2, 2] == 1.0 and w[3, 3] == 1.0
    np.testing.assert_allclose(w[:2, :2], [[0.5, 0.5], [0.5, 0.5]])


def test_reweight_and_mix():
    row = {0: T, 1: T, 3: T}
    assert reweight(row, 0, {1, 3}) == row
    r = reweight(row, 0, {1})
    assert r == pytest.approx({0: 2 * T, 1: T})
    p = reweight(row, 0, {1}, "proportional")
    assert p == pytest.approx({0: 0.5, 1: 0.5})
    x = {0: np.array([1.0, 0.0], np.float32), 1: np.array([0.0, 3.0], np.float32)}
    out = mix({0: 0.25, 1: 0.75}, x)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [0.25, 2.25])


def test_generators():
    assert sorted(generate_graph("ring", 5).edges()) == [(0, 1), (0, 4), (1, 2), (2, 3), (3, 4)]
    g = generate_graph("grid", 6)  # 2 x 3 grid: 7 edges
    assert g.number_of_nodes() == 6 and g.number_of_edges() == 7
    assert generate_graph("complete", 5).number_of_edges() == 10
    er1 = generate_graph("erdos-renyi", 8, seed=3, p=0.4)
    er2 = generate_graph("erdos-renyi", 8, seed=3, p=0.4)
    assert sorted(er1.edges()) == sorted(er2.edges())
    import networkx as nx

    assert nx.is_connected(er1)
    knn = generate_graph("knn", 10, k=3, seed=1)
    assert min(d for _, d in knn.degree()) >= 3
    assert all(0 < d["weight"] <= 1 for *_, d in knn.edges(data=True))
    with pytest.raises(ConfigError, match="ring"):
        generate_graph("torus", 4)


def test_make_topology_and_mixing():
    topo = make_topology("ring", 4, ports=[1, 2, 3, 4])
    assert topo.neighbours(0) == [1, 3]
    assert topo.peer(2).address == "127.0.0.1:3"
    np.testing.assert_allclose(topo.mixing_matrix(), mixing_matrix(RING4))


def test_network_file_roundtrip_and_fingerprint(tmp_path):
    topo = make_topology("knn", 5, k=2, seed=0, mixing="laplacian")
    f = tmp_path / "net.toml"
    f.write_text(topo.to_toml() + "\n[run]\nalgorithm = 'dfl-gt'\n")
    back = load_topology(f)
    assert back == topo
    assert back.fingerprint == topo.fingerprint
    changed = make_topology("ring", 5, mixing="laplacian")
    assert changed.fingerprint != topo.fingerprint


def test_edge_list_file_and_errors(tmp_path):
    el = tmp_path / "edges.txt"
    el.write_text("# path\n0 1\n1 2 0.5\n")
    topo = make_topology(str(el))
    assert topo.n == 3 and topo.edges == ((0, 1, 1.0), (1, 2, 0.5))
    el.write_text("0 1\n1 0\n")
    with pytest.raises(ConfigError, match="twice"):
        make_topology(str(el))
    bad = tmp_path / "bad.toml"
    bad.write_text('[[peers]]\nid = 0\naddress = "localhost"\n')
    with pytest.raises(ConfigError, match="HOST:PORT"):
        load_topology(bad)
    bad.write_text('[[peers]]\nid = 0\naddress = "h:1"\n[[peers]]\nid = 2\naddress = "h:2"\n')
    with pytest.raises(ConfigError, match="0..1"):
        load_topology(bad)
    bad.write_text('[network]\ncolour = "red"\n[[peers]]\nid = 0\naddress = "h:1"\n')
    with pytest.raises(ConfigError, match="colour"):
        load_topology(bad)
    bad.write_text('[[peers]]\nid = 0\naddress = "h:1"\n[[peers]]\nid = 1\naddress = "h:2"\n[[edges]]\nnodes = [0, 5]\n')
    with pytest.raises(ConfigError, match="outside"):
        load_topology(bad)
