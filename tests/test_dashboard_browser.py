"""graphfl dashboard in a real browser: headless Chromium (Debian's ``chromium`` + ``chromium-driver``,
driven by selenium) on real run folders made by the test, the dashboard started by the real CLI.

Without /usr/bin/chromium, /usr/bin/chromedriver or selenium the tests are skipped with the reason;
with ``CI=true`` they fail instead. Screenshots go to ``$GRAPHFL_ARTIFACTS`` (else the test's tmp
folder) as ``dashboard-*.png``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from graphfl.tests.conftest import in_ci

try:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
except ImportError:  # the tests skip (or fail under CI) in the browser fixture
    By = Keys = None  # type: ignore[assignment,misc]

pytestmark = pytest.mark.e2e

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
GRAPHFL = Path(sys.executable).with_name("graphfl")
ADDRESS = re.compile(r"dashboard\W+(http://127\.0\.0\.1:\d+/)")


def _need_browser() -> None:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium package (pip install -e '.[test]')")
    if missing:
        why = f"no headless browser: missing {', '.join(missing)} (apt-get install chromium chromium-driver)"
        if in_ci():
            pytest.fail(why)
        pytest.skip(why)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    _need_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1800"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture()
def artifacts(tmp_path) -> Path:
    folder = Path(os.environ.get("GRAPHFL_ARTIFACTS", tmp_path))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


class Proc:
    """A ``graphfl`` process with its output in a file; stopped (SIGINT, then SIGKILL) at the end."""

    def __init__(self, log: Path, *args: str) -> None:
        self.log = log
        self._out = log.open("w")
        self.proc = subprocess.Popen([str(GRAPHFL), *args], stdout=self._out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "250"})

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def address(self, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = ADDRESS.search(self.text())
            if m:
                return m.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"no dashboard address printed:\n{self.text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
        self._out.close()


@pytest.fixture()
def procs() -> Iterator[Callable[..., Proc]]:
    started: list[Proc] = []

    def start(log: Path, *args: str) -> Proc:
        p = Proc(log, *args)
        started.append(p)
        return p

    yield start
    for p in reversed(started):
        p.stop()


def _wait(cond: Callable[[], Any], timeout: float, what: str, step: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _retry(action: Callable[[], Any]) -> Any:
    """``action`` on an element found afresh, again when the page's redraw replaced it meanwhile."""
    from selenium.common.exceptions import StaleElementReferenceException

    for _ in range(20):
        try:
            return action()
        except StaleElementReferenceException:
            time.sleep(0.05)
    return action()


def _js(driver: Any, script: str) -> Any:
    return driver.execute_script(script)


def _text(driver: Any, selector: str) -> str:
    """The text of ``selector`` read in one script (the page redraws its sections on every poll, so
    a held element reference goes stale)."""
    return str(driver.execute_script("const e = document.querySelector(arguments[0]);"
                                     " return e ? e.innerText : '';", selector))


ROUND_JS = ("const s = document.querySelector('#folder-0 .last-round');"
            " return s ? s.getAttribute('data-round') : null;")
TABLE_JS = ("return [...document.querySelectorAll('#folder-0 table.grid tr[data-id]')].map(r =>"
            " [r.dataset.id, r.className, r.querySelector('[data-col=last_round]').textContent,"
            "  (r.querySelector('[data-col=error]') || {}).textContent || '']);")
GRAPH_JS = ("const g = document.querySelector('#folder-0 svg.graph'); return g ? [g.dataset.round,"
            " [...g.querySelectorAll('line.edge')].map(e => e.dataset.w).join(' ')] : null;")
LABEL_JS = "const s = document.querySelector('#folder-0 .round-label'); return s ? s.textContent : '';"
CURVE_JS = ("return [...document.querySelectorAll('#folder-0 polyline.series')].map(p =>"
            " [p.dataset.name, p.dataset.lastX]);")


def test_live_inprocess_run_curves_and_table_reach_the_last_round(browser, procs, tmp_path, artifacts):
    out = tmp_path / "run"
    rounds = 6
    dash = procs(tmp_path / "dash.log", "dashboard", str(out))
    browser.get(dash.address())
    _wait(lambda: "no such folder" in _text(browser, "#folder-0"), 60,
          "the page saying the run folder does not exist yet")
    load_id = _js(browser, "return document.body.dataset.loadId")
    run = procs(tmp_path / "run.log", "run", "--engine", "inprocess", "--strategy", "jgesr", "--rounds", str(rounds),
                "--nodes", "3", "--out", str(out))
    seen: list[int] = []

    def page_round() -> int | None:
        r = _js(browser, ROUND_JS)
        if r not in (None, "") and (not seen or seen[-1] != int(r)):
            seen.append(int(r))
        return seen[-1] if seen else None

    # A round of this small run can take less than the page's poll interval, so the run is held
    # (SIGSTOP) after its first finished round until the page has shown it: the page must show a
    # round before the last while the run is going, on a fast machine too.
    progress = out / "run.json"  # rewritten (atomically) after every round

    def finished_rounds() -> int:
        try:
            doc = json.loads(progress.read_text())
        except (OSError, ValueError):
            return 0
        rows = [r for m in (doc.get("methods") or {}).values() for r in (m.get("curve") or [])]
        return max((int(r.get("round", 0)) for r in rows), default=0)

    _wait(lambda: finished_rounds() >= 1 or run.proc.poll() is not None, 600,
          f"the run's first round in {progress} (run log: {run.log})", step=0.005)
    assert run.proc.poll() is None, f"the run ended before the test could hold it:\n{run.text()[-3000:]}"
    run.proc.send_signal(signal.SIGSTOP)
    try:
        held = int(_wait(lambda: page_round() or None, 60, "the held run's round on the page"))
        assert held < rounds, f"the run was held at round {held}, already the last"
        assert _js(browser, GRAPH_JS)[0] == str(held), "the learned graph shows the newest round"
    finally:
        run.proc.send_signal(signal.SIGCONT)
    _wait(lambda: page_round() == rounds, 600, f"round {rounds} on the page (rounds seen: {seen}; run log: {run.log})")
    assert run.proc.wait(timeout=120) == 0, run.text()[-3000:]
    assert _js(browser, "return document.body.dataset.loadId") == load_id, "the page was reloaded"
    assert len(seen) >= 2 and seen == sorted(seen), f"the page never showed a round before the last: {seen}"
    curves = dict(_js(browser, CURVE_JS))
    assert float(curves["test_loss"]) == rounds and float(curves["train_loss"]) == rounds
    rows = _js(browser, TABLE_JS)
    assert [r[0] for r in rows] == ["0", "1", "2"]
    assert all(r[1] == "ok" and r[2] == str(rounds) for r in rows), rows
    assert "completed" in _text(browser, "#folder-0 .badge")
    # the learned graph followed the run to its last round; the slider shows any earlier one
    newest = _wait(lambda: _js(browser, GRAPH_JS), 10, "the learned graph")
    assert newest[0] == str(rounds), f"the graph did not follow the newest round: {newest[0]}"
    _retry(lambda: browser.find_element(By.CSS_SELECTOR, "#folder-0 input.round-slider").send_keys(Keys.HOME))
    first = _wait(lambda: (g := _js(browser, GRAPH_JS)) and g[0] == "1" and g, 10, "round 1 after Home")
    assert first[1] != newest[1], "round 1's learned graph is drawn, not the newest one again"
    polls = int(_js(browser, "return document.body.dataset.polls"))
    _wait(lambda: int(_js(browser, "return document.body.dataset.polls")) > polls + 1, 30, "two more polls")
    assert _js(browser, GRAPH_JS) == first, "a redraw kept the chosen round"
    assert f"newest: {rounds}" in _js(browser, LABEL_JS)
    _retry(lambda: browser.find_element(By.CSS_SELECTOR, "#folder-0 button.round-next").click())
    assert _wait(lambda: _js(browser, GRAPH_JS)[0] == "2", 10, "round 2 after the next-round button")
    browser.save_screenshot(str(artifacts / "dashboard-run-round-2.png"))
    _retry(lambda: browser.find_element(By.CSS_SELECTOR, "#folder-0 button.round-newest").click())
    assert _wait(lambda: _js(browser, GRAPH_JS) == newest, 10, "the newest round again")
    browser.save_screenshot(str(artifacts / "dashboard-run.png"))


def test_live_p2p_network_graph_and_peer_table(browser, procs, tmp_path, artifacts):
    out = tmp_path / "p2p"
    rounds, peers = 12, 5
    dash = procs(tmp_path / "dash.log", "dashboard", str(out))
    browser.get(dash.address())
    net = procs(tmp_path / "p2p.log", "p2p", "--peers", str(peers), "--rounds", str(rounds), "--topology", "ring",
                "--out", str(out), "--quiet", "--insecure", "--set", "min-round-seconds=0.4")
    seen: list[int] = []

    def at_last() -> bool:
        r = _js(browser, ROUND_JS)
        if r not in (None, "") and (not seen or seen[-1] != int(r)):
            seen.append(int(r))
        return bool(seen) and seen[-1] == rounds and "completed" in _text(browser, "#folder-0 .badge")

    _wait(at_last, 600, f"round {rounds} and 'completed' on the page (seen {seen}; log {net.log})")
    assert net.proc.wait(timeout=120) == 0, net.text()[-3000:]
    assert len(seen) >= 2, f"the page never showed a round before the last: {seen}"
    g = _js(browser, "const g = document.querySelector('#folder-0 svg.graph'); return g ? "
                     "[g.querySelectorAll('circle.node').length, g.querySelectorAll('line.edge').length] : null;")
    assert g == [peers, peers], f"a ring of {peers}: {peers} nodes and {peers} edges, the page draws {g}"
    rows = _js(browser, TABLE_JS)
    assert [r[0] for r in rows] == [str(i) for i in range(peers)]
    assert all(r[1] == "ok" and r[2] == str(rounds) for r in rows), rows
    browser.save_screenshot(str(artifacts / "dashboard-p2p.png"))


def test_failed_run_bad_folder_and_bench_results(browser, procs, tmp_path, artifacts):
    failed, unknown = tmp_path / "failed", tmp_path / "not-a-run"
    res = subprocess.run([str(GRAPHFL), "run", "--engine", "inprocess", "--rounds", "2", "--nodes", "3",
                          "--set", "train.lr=1e12", "--set", "train.local-steps=5", "--out", str(failed)],
                         capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert res.returncode == 1 and json.loads((failed / "run.json").read_text())["status"] == "failed"
    unknown.mkdir()
    (unknown / "notes.txt").write_text("not a run")
    half = tmp_path / "half"
    half.mkdir()
    (half / "run.json").write_text((failed / "run.json").read_text()[:200])
    bench = Path(__file__).resolve().parents[1] / "docs" / "results" / "dfl-quick"
    harness = bench.parent / "dfl-full"
    dash = procs(tmp_path / "dash.log", "dashboard", str(failed), str(unknown), str(half), str(bench), str(harness))
    browser.get(dash.address())
    _wait(lambda: _js(browser, "return document.body.dataset.polls"), 60, "the first poll")
    box = _text(browser, "#folder-0 .error-box")
    assert "0 valid replies of 3" in box
    colour = _js(browser, "return getComputedStyle(document.querySelector('#folder-0 .error-box')).color")
    assert colour in ("rgba(140, 29, 24, 1)", "rgb(140, 29, 24)")
    red = _js(browser, "return document.querySelectorAll('#folder-0 tr.failed').length")
    assert red == 3, "each client the error names is a red row"
    assert "is not a graphfl output folder" in _text(browser, "#folder-1")
    assert "run.json: not complete JSON" in _text(browser, "#folder-2")
    methods = json.loads((bench / "dfl.json").read_text())["methods"]
    assert _js(browser, "return document.querySelectorAll('#folder-3 table.bench tr.method').length") == len(methods)
    assert "±" in _text(browser, "#folder-3")
    doc = json.loads((harness / "dfl.json").read_text())  # a harness result: rows, paired differences, verdicts
    assert _js(browser, "return document.querySelectorAll('#folder-4 table.bench tr.method').length") == len(doc["results"])
    assert _js(browser, "return document.querySelectorAll('#folder-4 table.bench tr.paired').length") == len(doc["paired"])
    statuses = _js(browser, "return [...document.querySelectorAll('#folder-4 .verdict-status')].map(e => e.dataset.status)")
    assert statuses == [v["verdict"] for v in doc["verdicts"].values()]
    browser.save_screenshot(str(artifacts / "dashboard-bad-input.png"))
    _js(browser, "document.querySelector('#folder-4').scrollIntoView(); return 1")
    browser.save_screenshot(str(artifacts / "dashboard-bench.png"))
    shutil.rmtree(half)  # a folder that vanishes: a message, the page keeps polling
    polls = int(_js(browser, "return document.body.dataset.polls"))
    _wait(lambda: int(_js(browser, "return document.body.dataset.polls")) > polls + 1, 30, "two more polls")
    assert "no such folder" in _text(browser, "#folder-2")
