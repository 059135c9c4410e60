"""Flower on a kombu_pgmq broker, in a real browser: Flower started with
``python -m kombu_pgmq.flower -A app flower``, a worker consuming ``celery``, headless
Chromium (Debian's ``chromium`` and ``chromium-driver``, driven by Selenium) opens the
Broker page and finds the queue with its message counts (Messages = Unacked + Ready +
Delayed, each in its column); ``/api/queues/length`` answers
the same. Without the module, Flower answers "'postgresql' broker is not supported".
Without ``FLOWER_UNAUTHENTICATED_API`` (and no authentication), Flower refuses its API with
401 and the text docs/guides/operations.md quotes, while the Broker page still shows.

The screenshot goes to ``$KOMBU_PGMQ_SCREENSHOTS/flower_broker.png`` when that variable
is set (``docs/`` holds the README's copy), else to the test's temporary directory.
Skipped when Chromium is not installed (``.ci/run`` installs it).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from kombu_pgmq._naming import pgmq_queue_name
from tests.e2e.helpers import REPO_ROOT, wait_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

pytestmark = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER),
    reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)",
)


#: Flower 2's answer (status 401) to an API call when it runs without authentication and
#: without FLOWER_UNAUTHENTICATED_API (flower/api/__init__.py).
UNAUTHENTICATED_API_REFUSED = (
    "FLOWER_UNAUTHENTICATED_API environment variable is required to enable API without "
    "authentication"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


class Flower:
    def __init__(
        self, env: dict[str, str], log: Path, *, patched: bool = True, open_api: bool = True
    ) -> None:
        """``open_api``: ``FLOWER_UNAUTHENTICATED_API=true`` in Flower's environment (Flower
        2 answers its API with 401 without it or authentication)."""
        self.port = _free_port()
        module = "kombu_pgmq.flower" if patched else "celery"
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    module,
                    "-A",
                    "tests.e2e.celery_app",
                    "flower",
                    "--address=127.0.0.1",
                    f"--port={self.port}",
                    "--conf=/dev/null",
                ],
                cwd=REPO_ROOT,
                env={
                    **{k: v for k, v in env.items() if k != "FLOWER_UNAUTHENTICATED_API"},
                    **({"FLOWER_UNAUTHENTICATED_API": "true"} if open_api else {}),
                },
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.url = f"http://127.0.0.1:{self.port}"

        def up() -> bool:
            assert self.proc.poll() is None, log.read_text()
            try:
                return _get(self.url + "/healthcheck")[0] == 200
            except OSError:
                return False

        wait_for(up, 60, "Flower to answer", interval=0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # never download a driver
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-background-networking",
        "--disable-dev-shm-usage",
        "--window-size=1280,720",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _queue_rows(driver: Any) -> dict[str, list[str]]:
    from selenium.webdriver.common.by import By

    rows = {}
    for tr in driver.find_elements(By.CSS_SELECTOR, "table tbody tr"):
        cells = [td.text.strip() for td in tr.find_elements(By.TAG_NAME, "td")]
        if cells:
            rows[cells[0]] = cells
    return rows


@pytest.mark.slow
def test_flower_broker_page_shows_our_queues(start_worker, app, db_dsn, e2e_env, tmp_path, browser):
    from selenium.webdriver.common.by import By

    start_worker(KPT_POLLING_INTERVAL="0.5")
    done = subprocess.run(
        [sys.executable, "-m", "kombu_pgmq", "queue", "pause", "celery", "--url", db_dsn],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    for i in range(4):  # held in the paused queue (one read below): something to count
        app.tasks["e2e.record"].delay(f"waiting {i}")
    app.tasks["e2e.record"].apply_async(("later",), countdown=600)  # delayed
    with psycopg.connect(db_dsn, autocommit=True) as conn:  # one in flight (read, not acked)
        read = conn.execute(
            "SELECT msg_id FROM pgmq.read(%s, 600, 1)", (pgmq_queue_name("celery"),)
        ).fetchall()
        assert len(read) == 1

    unpatched = Flower(e2e_env, tmp_path / "flower_unpatched.log", patched=False)
    try:
        status, body = _get(unpatched.url + "/api/queues/length")
        assert status == 404 and "'postgresql' broker is not supported" in body
    finally:
        unpatched.stop()

    # docs/guides/operations.md: the API needs FLOWER_UNAUTHENTICATED_API (or auth); the
    # Broker page does not.
    closed = Flower(e2e_env, tmp_path / "flower_closed_api.log", open_api=False)
    try:
        status, body = _get(closed.url + "/api/queues/length")
        assert (status, body) == (401, UNAUTHENTICATED_API_REFUSED), (status, body)
        status, body = _get(closed.url + "/broker")
        assert status == 200 and "celery" in body, (status, body)
    finally:
        closed.stop()
    docs = (REPO_ROOT / "docs" / "guides" / "operations.md").read_text(encoding="utf-8")
    assert " ".join(UNAUTHENTICATED_API_REFUSED.split()) in " ".join(docs.split()), (
        "docs/guides/operations.md quotes Flower's answer word for word"
    )

    flower = Flower(e2e_env, tmp_path / "flower.log")
    try:

        def lengths() -> dict[str, Any]:
            status, body = _get(flower.url + "/api/queues/length")
            assert status == 200, body
            queues = {q["name"]: q for q in json.loads(body)["active_queues"]}
            return queues if "celery" in queues and queues["celery"]["consumers"] >= 1 else {}

        celery = wait_for(lengths, 60, "Flower to list the worker's queues", interval=0.5)["celery"]
        assert (
            celery["messages"],
            celery["messages_unacknowledged"],
            celery["messages_ready"],
            celery["delayed"],
        ) == (5, 1, 3, 1)

        def page() -> dict[str, list[str]]:
            browser.get(flower.url + "/broker")
            rows = _queue_rows(browser)
            return rows if rows.get("celery", [None, None])[1] == "5" else {}

        rows = wait_for(
            page, 60, "the Broker page to show queue celery with 5 messages", interval=1.0
        )
        headers = [th.text.strip().title() for th in browser.find_elements(By.CSS_SELECTOR, "th")]
        assert headers[:5] == ["Queue", "Messages", "Unacked", "Ready", "Delayed"], headers
        # Messages = Unacked + Ready + Delayed
        assert rows["celery"][:5] == ["celery", "5", "1", "3", "1"], rows
        shots = Path(os.environ.get("KOMBU_PGMQ_SCREENSHOTS") or tmp_path)
        shots.mkdir(parents=True, exist_ok=True)
        assert browser.save_screenshot(str(shots / "flower_broker.png"))
    finally:
        flower.stop()
        subprocess.run(
            [sys.executable, "-m", "kombu_pgmq", "queue", "resume", "celery", "--url", db_dsn],
            cwd=REPO_ROOT,
            capture_output=True,
            timeout=60,
        )
