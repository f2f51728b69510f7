"""The console against a hostile page or a curious neighbour, over real HTTP to real `charlie
ui` processes (and Chromium where the point is what a browser does):

- no log line carries the token, a wrong one or a session (access log, HTTPError warnings,
  Tornado's parser), and a generated token is printed to a terminal only;
- no redirect leaves the console (``//evil.example/``, ``/\\evil.example``, ``next=//evil``);
- a request for a Host the console was not told of is refused (DNS rebinding);
- behind a TLS proxy every cookie is Secure; every cookie is HttpOnly and SameSite;
- a form's token is its session's: one from another session (or planted with a cookie) is
  refused, as is a browser's post from another origin, and nothing is recorded (I27);
- the token comes from the environment or a file; ``--token`` warns it is visible in ps.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import pty
import re
import select
import socket
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

import charlie
from charlie.domain import TaskStatus
from tests.console.conftest import CHROMEDRIVER, CHROMIUM, Console, _browser_problem, stop_console
from tests.console.test_auth_and_api import held_for_approval
from tests.support.cluster import REPO, Cluster, free_port

pytestmark = [pytest.mark.timeout(180), pytest.mark.backend_free]


@dataclass
class Started:
    base: str
    port: int
    token: str
    log: Path
    proc: subprocess.Popen[bytes]

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.base, follow_redirects=False, timeout=30, **kw)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def started(cluster: Cluster, *args: str, **env: str) -> Iterator[Started]:
    """`charlie ui --port P ARGS` with a token in CHARLIE_UI_TOKEN (``token=""``: none), its
    stdout and stderr in a file, answering on 127.0.0.1:P."""
    port = free_port()
    token = env.pop("token", f"hardening-{uuid.uuid4().hex}")
    log = cluster.home / f"console-{uuid.uuid4().hex[:8]}.log"
    environment = {**cluster.env, **({"CHARLIE_UI_TOKEN": token} if token else {}), **env}
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "charlie", "ui", "--port", str(port), *args],
            env=environment,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"charlie ui exited {proc.returncode}: {log.read_text()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base + "/", timeout=2).status_code == 401:
                break
        if time.monotonic() > deadline:
            stop_console(proc)
            raise AssertionError(f"charlie ui did not answer: {log.read_text()}")
        time.sleep(0.2)
    try:
        yield Started(base=base, port=port, token=token, log=log, proc=proc)
    finally:
        stop_console(proc)


def raw_get(
    port: int, target: str, headers: dict[str, str] | None = None
) -> http.client.HTTPResponse:
    """A GET of ``target`` exactly as written (httpx would normalise a ``\\`` or a ``//``)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", target, headers=headers or {})
    response = conn.getresponse()
    response.read()
    conn.close()
    return response


def is_local(location: str) -> bool:
    """Whether a browser reads this Location as a path of the same site."""
    parts = urlsplit(location.replace("\\", "/"))
    return (
        location.startswith("/")
        and not location.startswith(("//", "/\\"))
        and not (parts.scheme or parts.netloc)
    )


def form_token(page: str) -> str:
    found = re.search(r'name="_xsrf" value="([^"]+)"', page)
    assert found is not None, page[:2000]
    return found.group(1)


def new_chromium(*arguments: str) -> Any:
    problem = _browser_problem()
    if problem:
        pytest.skip(f"no browser for the console's tests: {problem}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                *arguments):  # fmt: skip
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    return driver


# -- the token in logs ----------------------------------------------------------------------------


def test_no_log_line_carries_the_token_a_wrong_one_or_a_session(cluster: Cluster) -> None:
    """Every request logged (CHARLIE_UI_LOG_LEVEL=INFO): a token in a page's address, on the
    API (refused there), under an encoded name, a wrong one, one on a forged post (Tornado's
    HTTPError warning), and a bearer token and a session cookie in a malformed header (Tornado's
    parser's line). The log says each request happened, with [redacted] where the token was."""
    wrong = f"wrong-token-{uuid.uuid4().hex}"
    with started(cluster, CHARLIE_UI_LOG_LEVEL="INFO") as ui:
        token = ui.token
        with ui.client() as http:
            login = http.get(f"/tasks/x?token={token}&keep=1")
            assert login.status_code == 303
            session = login.cookies["charlie_ui"]
            assert http.get(f"/api/tasks?token={token}").status_code == 200  # the session
        with ui.client() as http:
            assert http.get(f"/api/tasks?token={token}").status_code == 401
            assert http.get(f"/?token={wrong}").status_code == 401
            assert http.get(f"/nowhere?%74oken={token}").status_code == 303
            assert http.get(f"/nowhere/else?%74oken={wrong}").status_code == 401
            forged = http.post(f"/tasks/x/approve?token={token}", data={"call_id": "w"})
            assert forged.status_code == 403
        # a header Tornado's parser refuses, logged with its value
        with socket.create_connection(("127.0.0.1", ui.port), timeout=30) as raw:
            raw.sendall(
                f"GET /api/tasks HTTP/1.1\r\nHost: 127.0.0.1:{ui.port}\r\n"
                f"Cookie: charlie_ui={session}\r\n"
                f"Authorization: Bearer {token}\x01\r\n\r\n".encode()
            )
            with contextlib.suppress(OSError):
                raw.recv(4096)
        deadline = time.monotonic() + 30
        while "Malformed HTTP message" not in ui.output() and time.monotonic() < deadline:
            time.sleep(0.2)
        stop_console(ui.proc)  # every line written
        log = ui.output()
    for secret in (token, wrong, session, session.split("|")[-1]):
        assert secret not in log, (secret, log)
    assert "401 GET /api/tasks?token=[redacted]" in log, log
    assert "401 GET /?token=[redacted]" in log, log
    assert "303 GET /tasks/x?token=[redacted]&keep=1" in log, log
    assert "303 GET /nowhere?%74oken=[redacted]" in log, log
    assert "403 POST /tasks/x/approve?token=[redacted]" in log, log
    assert "Malformed HTTP message" in log and "Bearer [redacted]" in log, log


def test_a_generated_token_is_printed_to_a_terminal_only(cluster: Cluster) -> None:
    """stdout a pipe (a service's journal, a container's log): the address is printed without
    the token, which is in a file only its user can read; that token opens the console."""
    with started(cluster, token="") as ui:
        deadline = time.monotonic() + 30
        while "ui-token-" not in ui.output() and time.monotonic() < deadline:
            time.sleep(0.2)
        printed = ui.output()
        (kept,) = re.findall(r"<the token in (\S+)>", printed)
        path = Path(kept)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        token = path.read_text().strip()
        assert len(token) >= 32 and token not in printed
        with ui.client() as http:
            assert http.get(f"/?token={token}").status_code == 303
            assert http.get("/").status_code == 200


def test_a_generated_token_is_printed_on_the_operators_terminal(cluster: Cluster) -> None:
    """stdout a terminal: the whole address, token and all, as Jupyter does (not a log)."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "charlie", "ui", "--port", "0"],
        env=cluster.env,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=follower,
        stderr=follower,
        start_new_session=True,
    )
    os.close(follower)
    printed = b""
    try:
        deadline = time.monotonic() + 60
        while not re.search(rb"\?token=[A-Za-z0-9_-]{32,}\r?\n", printed):
            assert time.monotonic() < deadline and proc.poll() is None, printed
            if select.select([leader], [], [], 0.5)[0]:
                with contextlib.suppress(OSError):
                    printed += os.read(leader, 4096)
        (address,) = re.findall(r"(http://\S+\?token=\S+)", printed.decode())
        base = address.split("/?")[0]
        with httpx.Client(base_url=base, follow_redirects=False, timeout=30) as http:
            assert http.get(address.removeprefix(base)).status_code == 303
            assert http.get("/").status_code == 200
    finally:
        stop_console(proc)
        os.close(leader)


# -- redirects -----------------------------------------------------------------------------------


def test_a_redirect_never_leaves_the_console(console: Console, cluster: Cluster) -> None:
    token = console.token
    port = int(urlsplit(console.base).port or 0)
    for target in (
        f"//evil.example/?token={token}",
        f"//evil.example?token={token}",
        f"/\\evil.example/?token={token}",
        f"/\\/evil.example/?token={token}",
        f"/%2F%2Fevil.example/?token={token}",
        f"/tasks/x?token={token}&next=//evil.example",
        f"/?token={token}&next=/%5Cevil.example",
    ):
        response = raw_get(port, target)
        assert response.status == 303, (target, response.status)
        location = response.getheader("Location") or ""
        assert is_local(location), (target, location)
    # the same pages reached with the session: nothing to redirect, no such page
    with console.session() as http:
        cookie = http.cookies["charlie_ui"]
    answer = raw_get(port, "//evil.example/", {"Cookie": f"charlie_ui={cookie}"})
    assert answer.status == 404 and answer.getheader("Location") is None


def test_chromium_opening_an_off_site_login_address_stays_on_the_console(
    console: Console, browser: Any
) -> None:
    """What a browser makes of the login redirect of ``//evil.example/`` (and of a backslash,
    which it reads as a slash): it stays on the console, logged in, the token out of sight."""
    here = urlsplit(console.base).netloc
    for path in ("//evil.example/", "/\\evil.example/", "/?next=//evil.example/"):
        browser.get(console.base + path + ("&" if "?" in path else "?") + f"token={console.token}")
        assert urlsplit(browser.current_url).netloc == here, browser.current_url
        assert "token" not in browser.current_url


# -- hosts ----------------------------------------------------------------------------------------


def test_a_request_for_a_host_the_console_was_not_told_of_is_refused(cluster: Cluster) -> None:
    """By default the listening address, localhost, 127.0.0.1 and [::1] with the port; more
    with --allowed-host and CHARLIE_UI_ALLOWED_HOSTS (NAME: any port). Refused: the page, a
    login (no cookie set), the API with the bearer token, a post."""
    with started(cluster) as ui, ui.client() as http:
        bearer = {"Authorization": f"Bearer {ui.token}"}
        refused = http.get("/api/tasks", headers={**bearer, "Host": f"evil.example:{ui.port}"})
        assert refused.status_code == 403 and "tasks" not in refused.text
        assert http.get("/api/tasks", headers={**bearer, "Host": f"localhost:{ui.port}"}).is_success
    with started(
        cluster, "--allowed-host", "console.example", CHARLIE_UI_ALLOWED_HOSTS="other.example:9999"
    ) as ui:
        bearer = {"Authorization": f"Bearer {ui.token}"}
        for host in (
            f"evil.example:{ui.port}",
            "evil.example",
            f"127.0.0.1.evil.example:{ui.port}",
            f"127.0.0.1:{ui.port + 1}",
            "other.example:9998",
        ):
            with ui.client() as http:
                api = http.get("/api/tasks", headers={**bearer, "Host": host})
                assert api.status_code == 403, (host, api.status_code)
                assert "tasks" not in api.text
                login = http.get(f"/?token={ui.token}", headers={"Host": host})
                assert login.status_code == 403 and "set-cookie" not in login.headers, host
                post = http.post("/tasks/x/cancel", headers={"Host": host})
                assert post.status_code == 403, host
        for host in (
            f"127.0.0.1:{ui.port}",
            f"localhost:{ui.port}",
            f"[::1]:{ui.port}",
            f"LOCALHOST:{ui.port}",
            "console.example",
            "console.example:443",
            "other.example:9999",
        ):
            with ui.client() as http:
                answer = http.get("/api/tasks", headers={**bearer, "Host": host})
                assert answer.status_code == 200, (host, answer.text)
        assert f"127.0.0.1:{ui.port}" in ui.output() and "console.example (any port)" in ui.output()


def test_a_dns_rebinding_page_in_chromium_gets_nothing(cluster: Cluster) -> None:
    """Chromium resolving evil.example to 127.0.0.1 (what a rebinding attack achieves): the
    console refuses the name, so the page's origin reads nothing and no session is set."""
    with started(cluster) as ui:
        driver = new_chromium("--host-resolver-rules=MAP evil.example 127.0.0.1")
        try:
            driver.get(f"http://evil.example:{ui.port}/?token={ui.token}")
            body = driver.find_element("tag name", "body").text
            assert "does not answer to the host" in body, body
            assert driver.get_cookies() == []
            driver.get(f"http://127.0.0.1:{ui.port}/?token={ui.token}")
            assert driver.find_element("tag name", "table") is not None
            assert {c["name"] for c in driver.get_cookies()} == {"charlie_ui"}
        finally:
            driver.quit()


# -- cookies --------------------------------------------------------------------------------------


def _cookie(response: httpx.Response, name: str) -> str:
    (found,) = [c for c in response.headers.get_list("set-cookie") if c.startswith(f"{name}=")]
    return found


def test_behind_a_tls_proxy_every_cookie_is_secure(cluster: Cluster, script) -> None:
    """CHARLIE_UI_BEHIND_TLS_PROXY=1: the session and the flash cookies are Secure (a browser
    keeps them for https only, as the proxy serves it; this client, on plain HTTP to the
    console, sends them by hand as the proxy would), HttpOnly, SameSite, and there is no
    other cookie (no XSRF cookie: the form token is the session's)."""
    task_id = held_for_approval(script, "tls-1")
    with started(cluster, CHARLIE_UI_BEHIND_TLS_PROXY="1") as ui, ui.client() as http:
        login = http.get(f"/tasks/{task_id}?token={ui.token}")
        session = _cookie(login, "charlie_ui")
        for attribute in ("Secure", "HttpOnly", "SameSite=Lax", "Path=/"):
            assert attribute in session, session
        sent = {"Cookie": session.split(";")[0]}
        page = http.get(f"/tasks/{task_id}", headers=sent)
        assert page.status_code == 200
        assert "set-cookie" not in page.headers
        done = http.post(
            f"/tasks/{task_id}/approve",
            data={"call_id": "w", "_xsrf": form_token(page.text)},
            headers=sent,
        )
        assert done.status_code == 303, done.text
        flash = _cookie(done, "charlie_flash")
        for attribute in ("Secure", "HttpOnly", "SameSite=Strict", "Path=/"):
            assert attribute in flash, flash
        both = {"Cookie": f"{sent['Cookie']}; {flash.split(';')[0]}"}
        shown = http.get(f"/tasks/{task_id}", headers=both)
        assert "approved call w" in shown.text
        cleared = _cookie(shown, "charlie_flash")
        assert "Secure" in cleared and "SameSite=Strict" in cleared
    assert charlie.wait(task_id, timeout=60).status is TaskStatus.SUCCEEDED


def test_on_plain_http_cookies_are_httponly_and_samesite_but_not_secure(
    console: Console, cluster: Cluster, script
) -> None:
    """Without a proxy (http://127.0.0.1, a browser keeps no Secure cookie from a plain LAN
    address): not Secure, and still HttpOnly and SameSite, the flash cookie's too."""
    task_id = held_for_approval(script, "tls-2")
    with console.client() as http:
        login = http.get(f"/tasks/{task_id}?token={console.token}")
        session = _cookie(login, "charlie_ui")
        assert "Secure" not in session and "HttpOnly" in session and "SameSite=Lax" in session
        page = http.get(f"/tasks/{task_id}")
        done = http.post(
            f"/tasks/{task_id}/approve", data={"call_id": "w", "_xsrf": form_token(page.text)}
        )
        flash = _cookie(done, "charlie_flash")
        assert "Secure" not in flash and "HttpOnly" in flash and "SameSite=Strict" in flash


# -- forms ----------------------------------------------------------------------------------------


def test_a_form_token_from_another_session_is_refused(
    console: Console, cluster: Cluster, script
) -> None:
    """The attacker logs in (or reads a token from a page of theirs) and plants its form
    token, with the XSRF cookie it came with, in the victim's browser (a cookie set from a
    sibling subdomain or over plain HTTP): the victim's post with it is refused (I27: nothing
    is recorded), and so is a token from the same browser's previous session."""
    task_id = held_for_approval(script, "xsrf-bound")
    with console.session() as attacker:
        attackers_page = attacker.get(f"/tasks/{task_id}")
        planted = form_token(attackers_page.text)
        planted_cookie = attacker.cookies.get("_xsrf")
    with console.session() as victim:
        if planted_cookie:  # Tornado's own XSRF cookie, where there is one: plant it too
            victim.cookies.set("_xsrf", planted_cookie, domain="127.0.0.1")
        forged = victim.post(f"/tasks/{task_id}/approve", data={"call_id": "w", "_xsrf": planted})
        assert forged.status_code == 403, forged.text
        in_header = victim.post(
            f"/tasks/{task_id}/approve", data={"call_id": "w"}, headers={"X-XSRFToken": planted}
        )
        assert in_header.status_code == 403
        own = form_token(victim.get(f"/tasks/{task_id}").text)
        assert own != planted
        # logging in again starts a new session: the earlier session's token is refused
        assert victim.get(f"/tasks/{task_id}?token={console.token}").status_code == 303
        stale = victim.post(f"/tasks/{task_id}/approve", data={"call_id": "w", "_xsrf": own})
        assert stale.status_code == 403
        assert charlie.actions(task_id) == []
        fresh = form_token(victim.get(f"/tasks/{task_id}").text)
        ok = victim.post(f"/tasks/{task_id}/approve", data={"call_id": "w", "_xsrf": fresh})
        assert ok.status_code == 303
    (record,) = charlie.actions(task_id)
    assert record.action.value == "approve"
    assert charlie.wait(task_id, timeout=60).status is TaskStatus.SUCCEEDED


def test_a_browsers_post_from_another_origin_is_refused(
    console: Console, cluster: Cluster, script
) -> None:
    """Even with the session's own form token: a post a browser marks as cross-site (or
    whose Origin is another site's) is refused, and nothing is recorded (I27)."""
    task_id = held_for_approval(script, "origin-1")
    with console.session() as http:
        token = form_token(http.get(f"/tasks/{task_id}").text)
        for headers in (
            {"Sec-Fetch-Site": "cross-site", "Origin": "http://evil.example"},
            {"Sec-Fetch-Site": "same-site", "Origin": "http://localhost:1234"},
            {"Origin": "http://evil.example"},
        ):
            refused = http.post(
                f"/tasks/{task_id}/approve", data={"call_id": "w", "_xsrf": token}, headers=headers
            )
            assert refused.status_code == 403, headers
        assert charlie.actions(task_id) == []
        ok = http.post(
            f"/tasks/{task_id}/approve",
            data={"call_id": "w", "_xsrf": token},
            headers={"Sec-Fetch-Site": "same-origin", "Origin": console.base},
        )
        assert ok.status_code == 303
    assert charlie.wait(task_id, timeout=60).status is TaskStatus.SUCCEEDED


# -- where the token comes from ------------------------------------------------------------------


def test_the_token_from_a_file_and_a_warning_for_the_flag(cluster: Cluster, tmp_path: Path) -> None:
    token = f"from-a-file-{uuid.uuid4().hex}"
    secret = tmp_path / "ui-token"
    secret.write_text(token + "\n")
    secret.chmod(0o600)
    with started(cluster, "--token-file", str(secret), token="") as ui:
        with ui.client(headers={"Authorization": f"Bearer {token}"}) as http:
            assert http.get("/api/tasks").status_code == 200
        cmdline = Path(f"/proc/{ui.proc.pid}/cmdline").read_bytes()
        assert token.encode() not in cmdline
        assert "warning" not in ui.output() and token not in ui.output()
    secret.chmod(0o644)
    with started(cluster, "--token-file", str(secret), token="") as ui:
        assert "can be read by others (mode 0644)" in ui.output()
    # through CHARLIE_UI_TOKEN_FILE too
    secret.chmod(0o600)
    with (
        started(cluster, token="", CHARLIE_UI_TOKEN_FILE=str(secret)) as ui,
        ui.client(headers={"Authorization": f"Bearer {token}"}) as http,
    ):
        assert http.get("/api/tasks").status_code == 200
    # the flag still works, and says who else sees it
    flagged = f"on-the-command-line-{uuid.uuid4().hex}"
    with started(cluster, "--token", flagged, token="") as ui:
        with ui.client(headers={"Authorization": f"Bearer {flagged}"}) as http:
            assert http.get("/api/tasks").status_code == 200
        assert "--token is visible to every user of this machine" in ui.output()
    both = subprocess.run(
        [sys.executable, "-m", "charlie", "ui", "--port", "0", "--token-file", str(secret)],
        env={**cluster.env, "CHARLIE_UI_TOKEN": flagged},
        cwd=REPO,
        capture_output=True,
        timeout=60,
    )
    assert both.returncode == 2 and b"given twice" in both.stderr, both.stderr
    empty = tmp_path / "empty"
    empty.write_text("\n")
    none = subprocess.run(
        [sys.executable, "-m", "charlie", "ui", "--port", "0", "--token-file", str(empty)],
        env=cluster.env,
        cwd=REPO,
        capture_output=True,
        timeout=60,
    )
    assert none.returncode == 2 and b"is empty" in none.stderr, none.stderr
