"""The ops page in a real browser: the agent's app served by uvicorn on loopback after a run over a fake fleet, opened by headless Chromium (Debian's package); its DOM and a screenshot are checked for what a person sees."""
from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time

import pytest
import uvicorn

from radixserve.agent.app import build_app
from radixserve.bench.launch import free_port
from tests.unit.agent_fakes import HUNG, URLS, assert_shows_the_isolation, drained_fleet
from tests.unit.page_view import read_page

BROWSER_TIMEOUT_S = 120.0   # bounds a hang only: a cold start on a loaded 2-core box takes seconds
WAIT_S = 60.0
WINDOW = (1400, 1200)
# colours of page.py's CSS, as a person sees them: the red banner, a chart line, anomaly bars
BAD_BANNER, OK_BANNER = (0xFF, 0xEB, 0xE9), (0xDA, 0xFB, 0xE1)
LINE, BAR = (0x09, 0x69, 0xDA), (0xBC, 0x4C, 0x00)


def chromium() -> str:
    """Debian's chromium (or a chromium-browser); the test skips without one, and fails
    instead when RADIXSERVE_CI=1 (CI installs it, so its absence there is a defect)."""
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    reason = ("no chromium or chromium-browser on PATH (Debian: apt-get install -y "
              "--no-install-recommends chromium); the ops page browser test needs one")
    if os.environ.get("RADIXSERVE_CI") == "1":
        pytest.fail(reason + ", and RADIXSERVE_CI=1 requires it")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser() -> str:
    return chromium()


def browse(browser: str, tmp_path, *args: str) -> subprocess.CompletedProcess:
    """Run headless Chromium once with its own profile; fails the test on a non-zero exit."""
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", "--no-default-browser-check",
           f"--user-data-dir={tmp_path / 'profile'}",
           f"--window-size={WINDOW[0]},{WINDOW[1]}", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=BROWSER_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def page_url(browser, tmp_path_factory):
    """/status.html of an agent that isolated a hung worker, served by uvicorn in a thread
    (only once a browser was found)."""
    agent, fake = drained_fleet(tmp_path_factory.mktemp("agent"))
    assert fake.draining == {HUNG}
    server = uvicorn.Server(uvicorn.Config(build_app(agent, run_loop=False), host="127.0.0.1",
                                           port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.started, "the agent's app did not start"
    yield f"http://127.0.0.1:{server.config.port}/status.html"
    server.should_exit = True
    thread.join(WAIT_S)


def test_chromium_shows_the_fleet_the_isolation_with_its_evidence_and_the_charts(
        browser, page_url, tmp_path):
    view = read_page(browse(browser, tmp_path, "--dump-dom", page_url).stdout)
    rows = assert_shows_the_isolation(view)
    assert f"2 of 3 workers in rotation. {HUNG}: isolated (hung)." in view.text
    assert all(rows[u][2:4] == ["ok", "in"] and rows[u][8].endswith("%")
               for u in URLS if u != HUNG)
    (isolate,) = [r for r in view.rows if r[1].startswith("isolate ")]
    assert isolate[2:4] == [HUNG, "hung confirmed: isolate for 30 s (ejection 1)"]
    assert "unresponsive : /health failed on the last 3 sweeps (timeout)" in isolate[4]
    assert "errors timeout, timeout, timeout" in isolate[4] and isolate[5] == "ok"
    charts = view.charts
    assert charts["hit_rate"].coords == charts["hit_rate"].points >= 60
    assert charts["ttft_p99"].coords == charts["ttft_p99"].points >= 60
    assert charts["anomalies"].bars == 10 and charts["actions"].bars == 1
    for repr_ in ("None", "[]", "{}", "nan", "True", "False"):
        assert repr_ not in view.text, repr_


def test_the_screenshot_shows_a_red_banner_chart_lines_and_bars(browser, page_url, tmp_path):
    image = pytest.importorskip("PIL.Image")   # Pillow comes with matplotlib
    shot = tmp_path / "ops.png"
    browse(browser, tmp_path, f"--screenshot={shot}", "--hide-scrollbars", page_url)
    with image.open(shot) as im:
        assert im.size == WINDOW
        colours = {c: n for n, c in im.convert("RGB").getcolors(maxcolors=WINDOW[0] * WINDOW[1])}
    assert colours.get(BAD_BANNER, 0) >= 10_000 and OK_BANNER not in colours
    assert colours.get(LINE, 0) >= 50 and colours.get(BAR, 0) >= 50
