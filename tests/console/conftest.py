"""The run console under test: `charlie ui` as a real subprocess against the session's cluster,
and a headless Chromium (Debian's chromium + chromium-driver, through Selenium) to drive it.

Screenshots go to CHARLIE_TEST_SCREENSHOTS (default: a folder under pytest's tmp dir); the
folder is printed at the end of the session.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.cluster import REPO, Cluster, free_port
from tests.support.needs import need

TOKEN = "console-test-token-0123456789abcdef"
OPERATOR = "tester"
CHROMIUM = os.environ.get("CHARLIE_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CHARLIE_TEST_CHROMEDRIVER", "/usr/bin/chromedriver")

_SHOTS: dict[str, Any] = {"dir": None, "saved": []}


@dataclass
class Console:
    base: str
    token: str
    proc: subprocess.Popen[bytes]
    log: Path

    def client(self, **kw: Any) -> httpx.Client:
        """An HTTP client with no credentials (pass headers= or cookies= to add some)."""
        return httpx.Client(base_url=self.base, follow_redirects=False, timeout=30, **kw)

    def bearer(self) -> httpx.Client:
        return self.client(headers={"Authorization": f"Bearer {self.token}"})

    @contextlib.contextmanager
    def session(self) -> Iterator[httpx.Client]:
        """A client logged in the way a browser is: ?token= once, then the session cookie."""
        with self.client() as client:
            first = client.get(f"/?token={self.token}")
            assert first.status_code == 303, first.text
            yield client

    def url(self, path: str) -> str:
        return self.base + path


@pytest.fixture(scope="session")
def console(cluster_session: Cluster) -> Iterator[Console]:
    port = free_port()
    log = cluster_session.home / "console.log"
    # the token in the environment, not on a command line every user of the machine sees
    env = {**cluster_session.env, "CHARLIE_UI_TOKEN": TOKEN}
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "charlie", "ui", "--port", str(port), "--operator", OPERATOR],
            env=env,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"charlie ui exited {proc.returncode}: {log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base + "/", timeout=2).status_code == 401:
                break
        if time.monotonic() > deadline:
            raise RuntimeError(f"charlie ui did not answer: {log.read_text()[-3000:]}")
        time.sleep(0.2)
    yield Console(base=base, token=TOKEN, proc=proc, log=log)
    stop_console(proc)


def stop_console(proc: subprocess.Popen[bytes]) -> None:
    """Stop a `charlie ui` process: SIGTERM, then its whole group if it lingers."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _browser_problem() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    for path, _package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not (os.path.exists(path) or shutil.which(path)):
            return f"{path} is missing (apt-get install chromium chromium-driver)"
    return None


@pytest.fixture(scope="session")
def browser(console: Console) -> Iterator[Any]:
    """Headless Chromium, logged in to the console (its session cookie set)."""
    need(_browser_problem(), "no browser for the console's tests")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,1000",
        "--lang=en-US",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        driver.get(console.url(f"/?token={console.token}"))
        assert "token" not in driver.current_url  # it left the address bar at once
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="session")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = os.environ.get("CHARLIE_TEST_SCREENSHOTS")
    path = Path(folder) if folder else tmp_path_factory.mktemp("console-screenshots")
    path.mkdir(parents=True, exist_ok=True)
    _SHOTS["dir"] = path
    return path


def screenshot(driver: Any, folder: Path, name: str) -> Path:
    """The whole page, as tall as it is (to 5,000 px), through Chromium's DevTools."""
    # rows off screen are not painted until scrolled to (content-visibility): paint them all
    driver.execute_script(
        "document.querySelectorAll('.row').forEach(function (r) {"
        " r.style.contentVisibility = 'visible'; });"
    )
    metrics = driver.execute_cdp_cmd("Page.getLayoutMetrics", {})
    size = metrics.get("cssContentSize") or metrics["contentSize"]
    clip = {
        "x": 0,
        "y": 0,
        "width": size["width"],
        "height": min(size["height"], 5000),
        "scale": 1,
    }
    shot = driver.execute_cdp_cmd(
        "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip}
    )
    path = folder / f"{name}.png"
    path.write_bytes(base64.b64decode(shot["data"]))
    _SHOTS["saved"].append(path)
    return path


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _SHOTS["dir"] is not None:
        saved = ", ".join(p.name for p in _SHOTS["saved"]) or "none"
        terminalreporter.write_line(f"console screenshots in {_SHOTS['dir']}: {saved}")
