"""The chat page at / in real headless Chromium (Debian's chromium + chromium-driver, driven by
selenium): it shows the model, streams an answer with code blocks rendered, and the Stop button
ends the stream and frees the engine row.

The engine is the fake one (scripted words, a delay per token) so the stream is slow enough to
stop mid-way; the page only speaks HTTP, so this is the page's real path.
"""

from __future__ import annotations

import shutil
import tempfile
import time

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
if CHROMIUM is None or DRIVER is None:
    pytest.skip("chromium is absent: apt-get install -y chromium chromium-driver", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver")

from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from server.app import create_app  # noqa: E402
from server.config import ServerConfig  # noqa: E402
from tests.fake_engine import FakeEngine, ServerThread  # noqa: E402

ANSWER = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\nThat adds two numbers."
LONG = "word " * 400


@pytest.fixture(scope="module")
def fake():
    return FakeEngine()


@pytest.fixture(scope="module")
def server(fake):
    with ServerThread(create_app(fake, ServerConfig())) as s:
        yield s


@pytest.fixture(scope="module")
def browser():
    profile = tempfile.mkdtemp(prefix="mlxd-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run", f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=opts)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _script(fake, text):
    ids = fake.tokenizer.encode(text, add_special_tokens=False) + [fake.eos_id]
    return lambda request: ids


def _open(browser, server):
    browser.get(server.url + "/")
    WebDriverWait(browser, 20).until(lambda d: d.find_element(By.ID, "model-name").text == "tinycoder-16m")


def _send(browser, text):
    box = browser.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(text)
    browser.find_element(By.ID, "send").click()


def _last_assistant(browser):
    return browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]


def test_page_streams_an_answer_with_code_blocks(browser, server, fake):
    fake.reset(script=_script(fake, ANSWER), step_delay=0.02)
    _open(browser, server)
    _send(browser, "write add()")
    seen_partial = False
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        msg = _last_assistant(browser)
        if msg.get_attribute("data-done") == "1":
            break
        seen_partial = seen_partial or bool(msg.text)
        time.sleep(0.02)
    msg = _last_assistant(browser)
    assert msg.get_attribute("data-done") == "1" and msg.get_attribute("data-finish") == "stop"
    assert seen_partial  # text appeared before the stream ended: it streamed
    code = msg.find_element(By.CSS_SELECTOR, "pre code")
    assert code.text == "def add(a, b):\n    return a + b"
    assert msg.find_element(By.CSS_SELECTOR, "pre").get_attribute("data-lang") == "python"
    assert "That adds two numbers." in msg.text
    assert browser.find_element(By.ID, "status").text == "done (stop)"
    sent = fake.submits[-1]
    assert "write add()" in fake.tokenizer.decode(sent.prompt_ids)


def test_stop_button_ends_the_stream(browser, server, fake):
    fake.reset(script=_script(fake, LONG), step_delay=0.05)
    _open(browser, server)
    _send(browser, "talk forever")
    WebDriverWait(browser, 20).until(lambda d: len(_last_assistant(d).text) > 20)
    stop = browser.find_element(By.ID, "stop")
    assert stop.is_enabled() and not browser.find_element(By.ID, "send").is_enabled()
    stop.click()
    WebDriverWait(browser, 10).until(lambda d: _last_assistant(d).get_attribute("data-done") == "1")
    assert browser.find_element(By.ID, "status").text == "stopped"
    req_id = fake.submits[-1].req_id
    assert fake.wait_until(lambda: fake.aborted(req_id), 5), "the engine row was not freed"
    shown = _last_assistant(browser).text
    time.sleep(0.3)
    assert _last_assistant(browser).text == shown  # nothing more arrives after Stop
    assert 0 < len(shown) < len(LONG.strip())
    assert req_id not in fake.finished
    assert browser.find_element(By.ID, "send").is_enabled() and not stop.is_enabled()
