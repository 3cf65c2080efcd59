"""The status page (GET /ui) in a real browser, headless Chromium, against a real mlx child.

Each step checks the page and the effect behind it: Unload on the page ends the
engine's process, Load starts a new one, a child killed with SIGKILL shows as
restarting and comes back, and the child's own log lines reach the page.

Needs /usr/bin/chromium and /usr/bin/chromedriver (Debian: apt-get install
chromium chromium-driver); without them the tests fail, unless
BLAZAR_TEST_BROWSER=skip. BLAZAR_SCREENSHOTS=1 also rewrites the README's
screenshots, docs/status-page-desktop.png and docs/status-page-phone.png.
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import orjson
import pytest
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.e2e.conftest import ROOT, FakeEngine, StartGateway
from tests.e2e.test_engine_mlx import ENGINE, start_engine_gateway
from tests.e2e.test_engine_mlx import engine_installed as engine_installed
from tests.e2e.test_nonstream_via_stream import wait_idle
from tests.helpers import EngineGateway, engine_home, pid_alive

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
# The served name, which names the child's log file: this module's own.
NAME = "status-page"
# What mlx_lm.server writes once it listens (its own log line, with its port).
STARTED = "Starting httpd at 127.0.0.1 on port"
DESKTOP = (1280, 900)
PHONE = (390, 844)

T = TypeVar("T")

# Skipped only when told to (before any engine starts); a machine without the browser fails.
pytestmark = pytest.mark.skipif(
    os.environ.get("BLAZAR_TEST_BROWSER") == "skip", reason="BLAZAR_TEST_BROWSER=skip"
)

# ---- the browser


def _browser_or_fail() -> None:
    """A machine without the browser is a failure that says what to install."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        pytest.fail(
            f"the status page's browser tests need {' and '.join(missing)}: "
            "apt-get install chromium chromium-driver (or set BLAZAR_TEST_BROWSER=skip)",
            pytrace=False,
        )


@pytest.fixture
def browser(monkeypatch: pytest.MonkeyPatch) -> Iterator[webdriver.Chrome]:
    """Headless Chromium at 1280×900, its console log kept (goog:loggingPrefs browser ALL)."""
    _browser_or_fail()
    # Selenium Manager would otherwise try to download a driver.
    monkeypatch.setenv("SE_OFFLINE", "true")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        f"--window-size={DESKTOP[0]},{DESKTOP[1]}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        # The window's size is its outer size: the page's viewport is what the layout sees.
        driver.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {"width": DESKTOP[0], "height": DESKTOP[1], "deviceScaleFactor": 1, "mobile": False},
        )
        yield driver
    finally:
        driver.quit()


def console_problems(driver: webdriver.Chrome, allowed: Callable[[str], bool] = lambda _: False) -> list[str]:
    """The browser console's SEVERE entries (a JS error, a CSP violation) that ``allowed`` does not excuse."""
    entries: list[dict[str, Any]] = driver.get_log("browser")  # type: ignore[no-untyped-call]
    return [e["message"] for e in entries if e.get("level") == "SEVERE" and not allowed(e["message"])]


def wait_for(
    driver: webdriver.Chrome,
    timeout_s: float,
    condition: Callable[[webdriver.Chrome], T | None],
    what: str,
    log: Callable[[], str] = lambda: "",
) -> T:
    """``condition`` true (its value returned) within ``timeout_s``, or a failure showing the models."""
    try:
        value: T | None = WebDriverWait(driver, timeout_s, poll_frequency=0.1).until(condition)
        assert value is not None  # until() returns a true value
        return value
    except TimeoutException:
        models = driver.execute_script("return document.getElementById('models')?.outerHTML ?? ''")
        raise AssertionError(
            f"not within {timeout_s} s: {what}\n--- the page's models:\n{models}\n--- log:\n{log()[-4000:]}"
        ) from None


# Reads go through JS: the page renders a model's replicas anew on each change, so that
# an element found a moment ago may be gone.
_JS_MODEL_STATE = """
const row = document.querySelector(`[data-model="${CSS.escape(arguments[0])}"]`);
const badge = row && row.querySelector('.state[data-state]');
return badge ? badge.dataset.state : null;
"""
_JS_REPLICAS = """
const row = document.querySelector(`[data-model="${CSS.escape(arguments[0])}"]`);
if (!row) return [];
return [...row.querySelectorAll('[data-replica]')].map(
  (r) => ({name: r.dataset.replica, state: r.dataset.state, text: r.textContent}));
"""
_JS_ACTIVITY = """
const row = document.querySelector(`[data-request-id="${CSS.escape(arguments[0])}"]`);
if (!row) return null;
const heads = [...row.closest('table').querySelectorAll('thead th')].map((th) => th.textContent.trim());
const cells = [...row.children].map((td) => td.textContent.trim());
return {status: row.dataset.status, tps: cells[heads.indexOf('Tokens/s')] ?? null, cells};
"""
_JS_LOG = """
const pre = document.querySelector(`pre[data-log="${CSS.escape(arguments[0])}"]`);
return pre ? pre.textContent : null;
"""


def model_state(driver: webdriver.Chrome, model: str) -> str | None:
    state: str | None = driver.execute_script(_JS_MODEL_STATE, model)
    return state


def replicas(driver: webdriver.Chrome, model: str) -> list[dict[str, str]]:
    found: list[dict[str, str]] = driver.execute_script(_JS_REPLICAS, model)
    return found


def shown_pid(driver: webdriver.Chrome, model: str) -> int | None:
    """The pid the page shows for the model's one replica ("pid 1234" in its details), once ready."""
    shown = replicas(driver, model)
    if len(shown) != 1 or shown[0]["state"] != "ready":
        return None
    match = re.search(r"pid (\d+)\b", shown[0]["text"])
    return int(match.group(1)) if match else None


def click(driver: webdriver.Chrome, model: str, action: str) -> None:
    button = driver.find_element(By.CSS_SELECTOR, f'[data-model="{model}"] [data-action="{action}"]')
    wait_for(driver, 10, lambda _: button.is_enabled(), f"the {action} button of {model} enabled")
    button.click()


def is_engine_child(pid: int) -> bool:
    """A live process running the mlx server (not a zombie, not a reused pid of something else)."""
    if not pid_alive(pid):
        return False
    try:
        return b"mlx_lm_server.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False


# ---- screenshots


def screenshot(driver: webdriver.Chrome, path: Path, size: tuple[int, int], *, phone: bool) -> None:
    """The page at this viewport: the whole page on a desktop, the first screen on a phone."""
    width, height = size
    metrics = {"width": width, "height": height, "deviceScaleFactor": 2 if phone else 1, "mobile": phone}
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
    try:
        # Let the layout settle at the new width (two frames).
        driver.execute_async_script(
            "const done = arguments[0]; requestAnimationFrame(() => requestAnimationFrame(() => done()));"
        )
        shot: dict[str, Any] = {"format": "png"}
        if not phone:
            full = driver.execute_script("return document.documentElement.scrollHeight")
            shot |= {
                "captureBeyondViewport": True,
                "clip": {"x": 0, "y": 0, "width": width, "height": max(height, int(full)), "scale": 1},
            }
        data = driver.execute_cdp_cmd("Page.captureScreenshot", shot)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
    finally:
        driver.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {"width": DESKTOP[0], "height": DESKTOP[1], "deviceScaleFactor": 1, "mobile": False},
        )


# ---- the engine


@pytest.fixture
def mlx(engine_installed: None, logs_dir: Path) -> Iterator[EngineGateway]:
    gateway = start_engine_gateway(logs_dir, "--served-name", NAME)
    yield gateway
    gateway.stop()


def stream_chat(url: str) -> str:
    """A streamed chat with usage; its x-request-id."""
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 16,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with (
        httpx.Client(trust_env=False, timeout=60) as http,
        http.stream("POST", f"{url}/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200, response.read()
        text = response.read().decode()
    assert text.rstrip().endswith("data: [DONE]"), text
    usage = [orjson.loads(line[6:]) for line in text.splitlines() if '"usage"' in line][-1]["usage"]
    assert usage["completion_tokens"] > 0, text
    request_id: str = response.headers["x-request-id"]
    return request_id


def cancel_from_the_page(driver: webdriver.Chrome, gateway: EngineGateway, log: Callable[[], str]) -> str:
    """Start a generation far longer than the test, press its row's Cancel; its request id.

    The client's stream ends with request_cancelled, well short of max_tokens, and the engine
    goes idle: it was told (its connection closed), not left generating for nobody.
    """
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": "Tell a very long story."}],
        "max_tokens": 30_000,
        "stream": True,
    }
    with (
        httpx.Client(trust_env=False, timeout=60) as http,
        http.stream("POST", f"{gateway.url}/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200, response.read()
        request_id: str = response.headers["x-request-id"]
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"content"' in first or '"role"' in first, first

        def cancellable(d: webdriver.Chrome) -> Any:
            found = d.find_elements(
                By.CSS_SELECTOR, f'[data-request-id="{request_id}"] [data-action="cancel"]'
            )
            return found[0] if found and found[0].is_enabled() else None

        wait_for(driver, 20, cancellable, f"a Cancel button on {request_id}'s row", log).click()
        rest = list(lines)
    events = [line for line in rest if line.startswith("data: ")]
    assert "request_cancelled" in events[-1], events[-3:]
    assert len(events) < 5_000  # cut short: at ~700 tok/s 30000 tokens would take most of a minute
    pid = shown_pid(driver, NAME)
    assert pid is not None
    wait_idle(pid)
    return request_id


def wait_served(driver: webdriver.Chrome, request_id: str, log: Callable[[], str]) -> dict[str, Any]:
    """The request's activity row once it shows status 200 and a tokens/s number."""

    def served(d: webdriver.Chrome) -> dict[str, Any] | None:
        row: dict[str, Any] | None = d.execute_script(_JS_ACTIVITY, request_id)
        return row if row and row["status"] == "200" and re.fullmatch(r"[\d.]+", row["tps"] or "") else None

    return wait_for(driver, 20, served, f"activity row {request_id} with status 200 and tokens/s", log)


@pytest.mark.timeout(240)
@pytest.mark.fault("engines", "a child that crashes, hangs or turns unhealthy")
def test_the_status_page_shows_and_drives_a_real_engine(
    mlx: EngineGateway, browser: webdriver.Chrome
) -> None:
    """Loaded, a request with its tokens/s, Unload and Load (the process ends, a new one starts),
    a SIGKILLed child shown restarting and then ready again, and the child's own log lines, in the page."""
    log = mlx.log
    browser.get(f"{mlx.url}/ui")

    # 1. The model, loaded, with its one replica ready and the pid the gateway started.
    wait_for(browser, 20, lambda d: model_state(d, NAME) == "loaded", f"{NAME} shown loaded", log)
    first = wait_for(browser, 20, lambda d: shown_pid(d, NAME), f"{NAME}'s replica ready", log)
    assert first == mlx.child_pid
    child = replicas(browser, NAME)[0]["name"]

    # 2. A streamed request: its row, status 200 and a tokens/s figure.
    request_id = stream_chat(mlx.url)
    row = wait_served(browser, request_id, log)
    assert float(row["tps"]) > 0, row

    if os.environ.get("BLAZAR_SCREENSHOTS") == "1":
        # A few more rows, and a point on the charts (one every 10 s), for the README's pictures.
        for more in [stream_chat(mlx.url) for _ in range(3)]:
            wait_served(browser, more, log)
        with contextlib.suppress(TimeoutException):
            WebDriverWait(browser, 15, poll_frequency=0.2).until(
                lambda d: d.find_elements(By.CSS_SELECTOR, "svg path.line:not(.empty)")
            )
        screenshot(browser, ROOT / "docs" / "status-page-desktop.png", DESKTOP, phone=False)
        screenshot(browser, ROOT / "docs" / "status-page-phone.png", PHONE, phone=True)

    # 2b. Cancel, on a long generation's row: its client gets request_cancelled, the engine stops.
    cancelled = cancel_from_the_page(browser, mlx, log)
    # Its head had gone out (200): the row ends with the error its stream ended with.
    wait_for(
        browser,
        20,
        lambda d: (
            (r := d.execute_script(_JS_ACTIVITY, cancelled))
            and r["status"] != "in-flight"
            and any("request_cancelled" in cell for cell in r["cells"])
        ),
        f"activity row {cancelled} ended with request_cancelled",
        log,
    )

    # 3. Unload: the page says unloaded, and the engine's process is gone.
    click(browser, NAME, "unload")
    wait_for(browser, 30, lambda d: model_state(d, NAME) == "unloaded", f"{NAME} shown unloaded", log)
    wait_for(browser, 10, lambda _: not pid_alive(first), f"the child {first} gone after unload", log)

    # 4. Load: loaded again, served by a new process.
    click(browser, NAME, "load")
    wait_for(browser, 120, lambda d: model_state(d, NAME) == "loaded", f"{NAME} shown loaded again", log)
    second = wait_for(browser, 20, lambda d: shown_pid(d, NAME), f"{NAME}'s new replica ready", log)
    assert second != first and is_engine_child(second), (first, second)

    # 5. SIGKILL the child: its replica is shown restarting, then ready again with a new pid.
    os.kill(second, signal.SIGKILL)
    seen: list[str] = []  # the replica's states as the page showed them, in order

    def back(d: webdriver.Chrome) -> int | None:
        for r in replicas(d, NAME):
            if r["name"] == child and (not seen or seen[-1] != r["state"]):
                seen.append(r["state"])
        pid = shown_pid(d, NAME)
        return pid if pid not in (None, second) else None

    third = wait_for(browser, 120, back, f"{child} ready again after SIGKILL", log)
    assert is_engine_child(third) and not pid_alive(second), (second, third)
    # Shown as restarting from the crash on (not stopped, as an unloaded child is), then ready.
    assert "restarting" in seen and "stopped" not in seen, f"{child}'s states shown after SIGKILL: {seen}"
    assert model_state(browser, NAME) == "loaded"

    # The child's log in the page holds what the engine wrote: the startup line of each of its
    # three processes (one in the first snapshot, two sent live), the last one with its port.
    child_file = (engine_home() / "logs" / f"{ENGINE}--{NAME}.log").read_text(errors="replace")
    port = re.findall(rf"{STARTED} (\d+)", child_file)[-1]

    def logged(d: webdriver.Chrome) -> str | None:
        text: str | None = d.execute_script(_JS_LOG, child)
        return text if text and text.count(STARTED) >= 3 and f"{STARTED} {port}" in text else None

    text = wait_for(
        browser, 20, logged, f"three startup lines, the last on port {port}, in {child}'s log", log
    )
    ours = [line for line in text.splitlines() if STARTED in line]
    assert all(line in child_file for line in ours), (ours, child_file[-2000:])

    assert console_problems(browser) == []


# ---- the API key


@pytest.mark.timeout(60)
def test_the_status_page_asks_for_the_api_key(
    engine: FakeEngine, start_gateway: StartGateway, browser: webdriver.Chrome
) -> None:
    """With --api-key the page asks for the key: a wrong one is refused, the right one shows the models."""
    gateway = start_gateway({"fake": f"{engine.url}/v1"}, "--api-key", "sk-test")
    browser.get(f"{gateway.url}/ui")
    label = wait_for(
        browser,
        20,
        lambda d: next(
            (
                e
                for e in d.find_elements(By.XPATH, "//label[normalize-space()='API key']")
                if e.is_displayed()
            ),
            None,
        ),
        "an input labelled API key",
        gateway.log,
    )
    field = browser.find_element(By.ID, label.get_attribute("for") or "")
    assert browser.find_elements(By.CSS_SELECTOR, '[data-model="fake"]') == []

    field.send_keys("sk-wrong\n")
    wait_for(
        browser,
        20,
        lambda d: field.is_displayed() and "refused" in d.find_element(By.TAG_NAME, "body").text,
        "the wrong key refused and asked for again",
        gateway.log,
    )
    assert browser.find_elements(By.CSS_SELECTOR, '[data-model="fake"]') == []

    field.send_keys("sk-test\n")
    wait_for(browser, 20, lambda d: model_state(d, "fake") == "loaded", "model fake shown", gateway.log)
    assert not field.is_displayed()

    # Each refused GET /events is a 401 the browser logs as a failed load; nothing else may be.
    assert console_problems(browser, lambda m: "/events" in m and "401" in m) == []
