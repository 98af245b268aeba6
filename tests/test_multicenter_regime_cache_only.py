"""Bench ``multicenter-regime``, BiG-FL form, cache-only report end to end: a tiny real run fills the
run cache; a cache-only render of that cache computes nothing and reports what the run reported; a
render after cells are deleted from the cache lists them (``missing_cells`` / ``missing_points``)
and calls the verdicts that need them ``not testable``, never a win or a loss."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from graphfl.bench import multicenter_regime as mr
from graphfl.tasks.holdout import validation_task

FORM = mr.Form(rounds=2, seeds=2, samples=(5, 20), stds=(0.1,), nodes=(6,), lr_grid=(1.0,), fesem_warmups=(10,))
SPEC = mr.BigflSpec(steps=(1.0,), lambdas=(0.1,), base_lam=0.1, other_kappas=(), lambda_extensions=0,
                     kappa_extensions=0)
A = {"nodes": 6, "samples": 5, "std": 0.1, "rounds": 2}
B = {"nodes": 6, "samples": 20, "std": 0.1, "rounds": 2}
VOLATILE = ("estimate", "seconds", "env")
"""Keys of the result that describe the run itself (time, cells computed), not its results."""
DOC = f"{mr.BIGFL_NAME}.json"
MD = f"{mr.BIGFL_NAME}.md"


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of one real run of the tiny BiG-FL form (its results and its complete run cache)."""
    out = tmp_path_factory.mktemp("full")
    mr.run(seed=0, out=out, spec=FORM, bigfl=SPEC)
    return out


def _doc(out: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((out / DOC).read_text())
    return doc


def _same(a: Any, b: Any, where: str = "doc") -> None:
    """``a`` and ``b`` equal, floats within a relative 1e-6."""
    if isinstance(a, float) or isinstance(b, float):
        assert b == pytest.approx(a, rel=1e-6, abs=1e-12), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _listing(cache: Path) -> dict[str, tuple[int, int]]:
    return {f.name: (f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(cache.iterdir())}


def _render(full: Path, out: Path, monkeypatch: pytest.MonkeyPatch,
            drop: Callable[[dict[str, Any]], bool] | None = None) -> tuple[dict[str, Any], str, list[dict[str, Any]]]:
    """A cache-only render into ``out`` of a copy of ``full``'s cache without the cells ``drop`` selects
    (by their cache key); asserts it computed nothing and left the cache as it found it.
    Returns the written result, its Markdown and the keys of the deleted cells.
    """
    cache = out / "cache"
    shutil.copytree(full / "cache", cache)
    dropped = []
    for f in sorted(cache.glob("*.json")):
        key = json.loads(f.read_text())["_key"]
        if drop is not None and drop(key):
            dropped.append(key)
            for g in cache.glob(f"{f.stem}.*"):
                g.unlink()
    before = _listing(cache)

    def must_not_run(*args: object, **kwargs: object) -> dict[str, Any]:
        raise AssertionError(f"a cache-only render computed a cell: {args}")

    monkeypatch.setattr(mr, "run_one", must_not_run)
    returned = mr.run(seed=0, out=out, spec=FORM, bigfl=SPEC, cache_only=True)
    assert _listing(cache) == before  # nothing written to the cache, nothing removed
    doc = _doc(out)
    _same(returned["verdicts"], doc["verdicts"])
    return doc, (out / MD).read_text(), dropped


def _key_of(method: str, point: dict[str, Any], seed: int, split: str) -> Callable[[dict[str, Any]], bool]:
    task = mr.TASK if split == "test" else validation_task(mr.TASK)
    return lambda k: (k["method"] == method and k["task"] == task and k["seed"] == seed
                      and k["data.client-samples"] == point["samples"] and k["data.cluster-std"] == point["std"])


def _verdicts_at(doc: dict[str, Any], point: dict[str, Any]) -> dict[str, Any]:
    (entry,) = [v for v in doc["verdicts"] if v["point"] == point]
    found: dict[str, Any] = entry
    return found


def _results_at(doc: dict[str, Any], point: dict[str, Any]) -> dict[str, Any]:
    return {r["method"]: r for r in doc["results"] if r["point"] == point}


def test_cache_only_render_computes_nothing_and_reports_what_the_run_did(full: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    ran = _doc(full)
    assert ran["config"]["points"] == [A, B]
    assert ran["missing_points"] == [] and ran["missing_cells"] == []
    for p in (A, B):
        for m in mr.methods_of(FORM, SPEC):
            assert mr.result(ran, m, **p)["metrics"]["mse"]["n"] == 2, (m, p)  # the run cache is complete
        assert all(e["verdict"] != "not testable" for k, e in _verdicts_at(ran, p).items() if " vs " in k)
    assert "Every point of the form is reported." in (full / MD).read_text()

    doc, md, dropped = _render(full, tmp_path, monkeypatch)
    assert dropped == []
    assert doc["estimate"]["cells_to_run"] == 0
    for k in ran:
        if k not in VOLATILE:
            _same(ran[k], doc[k], k)  # verdicts, results, paired, tuning, diagnostics, settings, missing
    assert "Every point of the form is reported." in md and "No test cell of a reported point is missing." in md


@pytest.mark.parametrize(("method", "seed"), [(mr.BIGFL, 1), ("FedAvg", 0)])
def test_a_test_cell_missing_from_the_cache_is_listed_and_makes_its_verdicts_not_testable(
        full: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str, seed: int) -> None:
    ran = _doc(full)
    doc, md, dropped = _render(full, tmp_path, monkeypatch, drop=_key_of(method, A, seed, "test"))
    assert len(dropped) == 1
    assert doc["missing_points"] == [] and doc["config"]["points"] == [A, B]  # its tuning is complete
    (label,) = doc["missing_cells"]
    assert "samples=5 " in label and f" {method} seed {seed}" in label and not label.endswith("(val)")
    assert "Test cells not in the cache (verdicts that need them: not testable): " + label in md

    needs = {k for k in _verdicts_at(ran, A) if " vs " in k and method in k.split(" vs ")}
    assert needs  # the deleted cell is in some verdict
    at = _verdicts_at(doc, A)
    for k, e in _verdicts_at(ran, A).items():
        if k in needs:
            assert at[k]["verdict"] == "not testable", k  # never a loss (nor a win) of the method with a cell missing
        elif k != "best":
            _same(e, at[k], k)
    _same(_verdicts_at(ran, B), _verdicts_at(doc, B), "verdicts at B")
    _same(_results_at(ran, B), _results_at(doc, B), "results at B")
    ra, da = _results_at(ran, A), _results_at(doc, A)
    for m in ra:
        if m != method:
            _same(ra[m], da[m], f"results at A, {m}")
    assert da[method]["metrics"]["mse"]["n"] == 1  # the other seed only, and the report says which is missing
    assert da[method]["failed"] == 1 and da[method]["missing"] == 1  # not run, not a failed run
    assert "0 (+1 not in the cache)" in md and all(r["missing"] == 0 for r in ran["results"])
    assert md.count("): not testable") == len(needs)  # the verdict table says so, for these only
    if method == mr.BIGFL:  # a missing run is no evidence that φ did not move
        (diag,) = [d for d in doc["bigfl_diagnostics"] if d["point"] == A]
        assert diag["phi_minus_identity"][seed] is None and seed not in diag["degenerate_seeds"]


def test_a_tuning_cell_missing_from_the_cache_leaves_its_point_out_and_listed(
        full: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran = _doc(full)
    doc, md, dropped = _render(full, tmp_path, monkeypatch, drop=_key_of(mr.BIGFL, B, 0, "val"))
    assert len(dropped) == 1
    assert doc["missing_points"] == [B] and doc["missing_cells"] == []
    assert doc["config"]["points"] == [A]
    assert [v["point"] for v in doc["verdicts"]] == [A]  # no verdict at B: neither a loss nor a win
    assert all(r["point"] == A for r in doc["results"])
    _same(_verdicts_at(ran, A), _verdicts_at(doc, A), "verdicts at A")
    _same(_results_at(ran, A), _results_at(doc, A), "results at A")
    assert "Points not run (their tuning is not complete in the run cache): n=6, m=20, std=0.1, R=2" in md
    assert "No test cell of a reported point is missing." in md
