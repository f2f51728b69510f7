"""``--only console``: the run console (``charlie ui``).

the run console (``charlie ui``) on a real run of 2,000 transcript items (scripted turns of
a message and four instant tool calls): the task page's server time over HTTP, its live
fragment and revision read, and the time to a usable page in headless Chromium (Selenium,
Debian's chromium + chromium-driver; the load event: the page parsed, styled and its
script running); then the list's first page, a page deep in it, a status filter and a
search, over 100,000 tasks inserted directly with SQL.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import statistics
import sys
import time
import uuid
from datetime import datetime
from typing import Any

from benchmarks.harness import TERMINAL, TOOL, Row, free_port, progress


class ConsoleFigure:
    """The task page over HTTP and in Chromium; the task list over 100,000 tasks."""

    def console(self) -> None:
        import httpx

        items = self.sizes.console_items
        per_turn = 9  # a message, four calls and their four results
        turns = max(1, items // per_turn)
        calls = [
            {"id": f"c{n}", "name": TOOL, "arguments": {"value": f"result {n} " + "x" * 40}}
            for n in range(4)
        ]
        model = self.script(
            "console", [{"say": "step", "tool_calls": calls}] * turns + [{"say": "done"}]
        )
        prefix = self.new_prefix("console")
        (task_id,) = self.submit(model, prefix, 1)
        self.wait_done(prefix, 1, timeout=600)
        from charlie import api

        shown = len(api.transcript(task_id))
        self.results.info["console.items"] = shown
        token = uuid.uuid4().hex + uuid.uuid4().hex
        port = free_port()
        argv = [sys.executable, "-m", "charlie", "ui", "--port", str(port)]
        self.procs.spawn("console", argv, {"CHARLIE_UI_TOKEN": token})
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/", timeout=2).status_code == 401:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError("charlie ui did not answer")
            time.sleep(0.2)
        # a page's time is noisy on a shared machine: at least 3 samples, but for the smoke run
        trials = self.sizes.trials if self.sizes.console_items < 1000 else max(3, self.sizes.trials)
        r = self.results
        with httpx.Client(base_url=base, timeout=120) as http:
            assert http.get(f"/?token={token}").status_code == 303
            page = f"/tasks/{task_id}"
            http.get(page)  # the first render compiles the templates
            for _ in range(trials):
                t0 = time.perf_counter()
                body = http.get(page)
                r.add("console.page_ms", 1000 * (time.perf_counter() - t0))
                assert body.status_code == 200
                assert shown <= 300 or 'id="all-rows"' in body.text  # the latest rows only
                r.add("console.page_kib", len(body.content) / 1024)
                t0 = time.perf_counter()
                assert http.get(page + "?all=1").status_code == 200
                r.add("console.page_all_ms", 1000 * (time.perf_counter() - t0))
                t0 = time.perf_counter()
                assert http.get(f"/live/tasks/{task_id}").status_code == 200
                r.add("console.fragment_ms", 1000 * (time.perf_counter() - t0))
                t0 = time.perf_counter()
                assert http.get(f"/api/tasks/{task_id}/revision").status_code == 200
                r.add("console.revision_ms", 1000 * (time.perf_counter() - t0))
            progress(
                f"console: task page of {shown} items in "
                f"{statistics.median(r.values['console.page_ms']):.0f} ms"
            )
            self.console_browser(base, token, page, trials)
            self.console_list(http, trials)
        self.procs.kill("console")

    def console_browser(self, base: str, token: str, page: str, trials: int) -> None:
        chromium, driver_path = "/usr/bin/chromium", "/usr/bin/chromedriver"
        missing = [p for p in (chromium, driver_path) if not os.path.exists(p)]
        if missing or importlib.util.find_spec("selenium") is None:
            why = f"{', '.join(missing)} missing" if missing else "selenium is not installed"
            self.results.notes.append(f"console: no time in a browser ({why})")
            return
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        options = webdriver.ChromeOptions()
        options.binary_location = chromium
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
            options.add_argument(arg)
        options.add_argument("--window-size=1400,1000")
        driver = webdriver.Chrome(service=Service(driver_path), options=options)
        try:
            driver.get(f"{base}/?token={token}")
            driver.get(base + page)  # warm: the static files are cached from here on
            timing = "return performance.getEntriesByType('navigation')[0].toJSON()"
            for _ in range(trials):
                driver.get("about:blank")
                t0 = time.perf_counter()
                driver.get(base + page)
                wall = 1000 * (time.perf_counter() - t0)
                nav = driver.execute_script(timing)
                self.results.add("console.browser_load_ms", float(nav["loadEventEnd"]))
                self.results.add("console.browser_dcl_ms", float(nav["domContentLoadedEventEnd"]))
                self.results.add("console.browser_wall_ms", wall)
                driver.get("about:blank")
                driver.get(base + page + "?all=1")
                nav = driver.execute_script(timing)
                self.results.add("console.browser_all_load_ms", float(nav["loadEventEnd"]))
        finally:
            driver.quit()
        progress(
            "console: usable in Chromium after "
            f"{statistics.median(self.results.values['console.browser_load_ms']):.0f} ms"
        )

    def console_list(self, http: Any, trials: int) -> None:
        """The list over many tasks, inserted directly (no run behind them)."""
        from datetime import UTC, timedelta

        from sqlalchemy import insert

        from charlie.domain import execution_id_for
        from charlie.store.engine import write
        from charlie.store.schema import executions, tasks

        n = self.sizes.console_tasks
        now = datetime.now(UTC)
        statuses = ["succeeded"] * 6 + ["failed", "canceled", "waiting", "running"]
        prefix = self.new_prefix("list")
        batch = 5000
        t0 = time.perf_counter()
        for start in range(0, n, batch):
            rows, runs = [], []
            for k in range(start, min(n, start + batch)):
                task_id = f"{prefix}{k:07d}"
                created = now - timedelta(seconds=n - k)
                status = statuses[k % len(statuses)]
                rows.append(
                    {
                        "id": task_id,
                        "prompt": f"benchmark task {k}: fix the build of service {k % 97}",
                        "model": "scripted:bench.json",
                        "metadata": {},
                        "status": status,
                        "created_at": created,
                    }
                )
                runs.append(
                    {
                        "id": execution_id_for(task_id),
                        "task_id": task_id,
                        "phase": "done" if status in TERMINAL else "await_tools",
                        "version": 7,
                        "state": {},
                        "turn": 1,
                        "next_seq": 6,
                        "updated_at": created,
                        "created_at": created,
                    }
                )
            with write(self.rt.engine) as conn:
                conn.execute(insert(tasks), rows)
                conn.execute(insert(executions), runs)
        progress(f"console: {n:,} tasks inserted in {time.perf_counter() - t0:.1f}s")
        deep = f"{prefix}{n // 2:07d}"
        pages = {
            "console.list_first_ms": "/",
            "console.list_deep_ms": f"/?before={deep}",
            "console.list_status_ms": "/?status=failed",
            "console.list_search_ms": f"/?q=service+{n % 97}",
        }
        for key, path in pages.items():
            assert http.get(path).status_code == 200
            for _ in range(trials):
                t0 = time.perf_counter()
                assert http.get(path).status_code == 200
                self.results.add(key, 1000 * (time.perf_counter() - t0))
        self.results.info["console.tasks"] = n
        progress(
            f"console: a list page over {n:,} tasks in "
            f"{statistics.median(self.results.values['console.list_first_ms']):.0f} ms"
        )


ROWS: list[Row | str] = [
    "**Console** (`charlie ui`: one run's page, the task list; sizes above)",
    Row("Task page (the latest 300 rows): server time over HTTP (ms)", "console.page_ms"),
    Row("Task page: size (KiB)", "console.page_kib"),
    Row("Task page with every row (?all=1): server time (ms)", "console.page_all_ms"),
    Row("Task page: its live fragment (ms)", "console.fragment_ms"),
    Row("Task page: the revision poll (ms)", "console.revision_ms", 1),
    Row("Task page in Chromium: usable (load event, ms)", "console.browser_load_ms"),
    Row("Task page in Chromium: DOM ready (ms)", "console.browser_dcl_ms"),
    Row("Task page with every row in Chromium: usable (ms)", "console.browser_all_load_ms"),
    Row("List: first page (ms)", "console.list_first_ms", 1),
    Row("List: a page halfway down (ms)", "console.list_deep_ms", 1),
    Row("List: a status filter's first page (ms)", "console.list_status_ms", 1),
    Row("List: a search's first page (ms)", "console.list_search_ms", 1),
]
