import json

from graphfl.common.results import render_markdown, write_results


def doc():
    return {
        "name": "demo",
        "config": {"rounds": 2},
        "methods": {
            "fedavg": {"final": {"test_loss": 0.5, "test_acc": 0.8},
                       "curve": [{"round": 0, "test_loss": 1.0, "test_acc": 0.1},
                                 {"round": 1, "test_loss": float("nan"), "test_acc": 0.5, "seconds": 1.5}]},
            "local": {"final": {"test_loss": 0.7, "test_acc": 0.6},
                      "curve": [{"round": 0, "test_loss": 1.0}, {"round": 1, "test_loss": 0.7}]},
        },
        "env": {"python": "3.11", "cpus": 2},
    }


def test_write_results_creates_json_md_png(tmp_path):
    paths = write_results(tmp_path, doc())
    assert set(paths) == {"json", "md", "png"}
    loaded = json.loads(paths["json"].read_text())
    assert loaded["methods"]["fedavg"]["curve"][1]["test_loss"] is None   # NaN -> null
    assert paths["png"].stat().st_size > 1000
    md = paths["md"].read_text()
    assert "| fedavg | 0.8000 | 0.5000 |" in md


def test_markdown_has_per_round_tables():
    md = render_markdown(doc())
    assert "## fedavg: per round" in md and "## local: per round" in md
    assert md.count("| round |") == 2


def test_rewrite_keeps_valid_json(tmp_path):
    write_results(tmp_path, doc(), plot=False)
    d = doc()
    d["methods"]["fedavg"]["final"]["test_acc"] = 0.9
    write_results(tmp_path, d, plot=False)
    assert json.loads((tmp_path / "demo.json").read_text())["methods"]["fedavg"]["final"]["test_acc"] == 0.9
    assert not list(tmp_path.glob(".*.tmp"))


def test_flower_records_keep_zero_dimensional_arrays() -> None:
    """0-d client-state entries and buffers (BatchNorm's num_batches_tracked) survive a record round trip."""
    import numpy as np

    from graphfl.common.records import arrays_to_record, record_to_arrays

    back = record_to_arrays(arrays_to_record({"count": np.asarray(3, np.int64), "w": np.ones((2, 3), np.float32)}))
    assert back["count"].shape == () and int(back["count"]) == 3 and back["w"].shape == (2, 3)
