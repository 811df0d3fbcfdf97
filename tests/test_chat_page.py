"""The chat page at / in real headless Chromium (Debian's chromium + chromium-driver, driven by
selenium): it shows the model, streams an answer with code blocks rendered, the Stop button ends
the stream and frees the engine row, the Settings toggle shows and hides its panel, a long answer
keeps its newest text and the status line on screen, and the page has an icon (no 404 for
/favicon.ico). The browser tests are skipped without chromium; the favicon's plain HTTP test is not.

The engine is the fake one (scripted words, a delay per token) so the stream is slow enough to
stop mid-way; the page only speaks HTTP, so this is the page's real path.
"""

from __future__ import annotations

import shutil
import tempfile
import time

import httpx
import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # the test extras are not installed
    webdriver = None  # type: ignore[assignment]

ANSWER = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\nThat adds two numbers."
LONG = "word " * 400


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None or DRIVER is None:
        pytest.skip("chromium is absent: apt-get install -y chromium chromium-driver")
    if webdriver is None:
        pytest.skip("selenium is absent: install the test extras")
    profile = tempfile.mkdtemp(prefix="mlxd-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run", "--window-size=800,600", f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
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


def test_settings_toggle_shows_and_hides_the_panel(browser, server, fake):
    fake.reset()
    _open(browser, server)
    panel = browser.find_element(By.ID, "settings")
    toggle = browser.find_element(By.ID, "settings-toggle")
    assert not panel.is_displayed() and toggle.get_attribute("aria-expanded") == "false"
    toggle.click()
    assert panel.is_displayed() and toggle.get_attribute("aria-expanded") == "true"
    assert browser.find_element(By.ID, "temperature").is_displayed()
    toggle.click()
    assert not panel.is_displayed() and toggle.get_attribute("aria-expanded") == "false"


GEOMETRY = """
const log = document.getElementById("log"), msgs = log.querySelectorAll(".msg.assistant");
const m = msgs[msgs.length - 1].getBoundingClientRect(), l = log.getBoundingClientRect();
const c = document.getElementById("composer").getBoundingClientRect();
const s = document.getElementById("status").getBoundingClientRect();
return {msgTop: m.top, msgBottom: m.bottom, logTop: l.top, logBottom: l.bottom,
        composerTop: c.top, statusTop: s.top, statusBottom: s.bottom, height: window.innerHeight,
        scrollTop: log.scrollTop};
"""


def _scrolled_past(g, px):
    return g["msgTop"] < g["logTop"] - px


def _assert_newest_text_visible(g):
    assert g["msgTop"] < g["logTop"]  # the answer is taller than the transcript: it scrolled
    assert g["logTop"] < g["msgBottom"] <= g["logBottom"] + 1  # its end is inside the transcript
    assert g["msgBottom"] <= g["composerTop"] + 1  # ... and not under the composer
    assert g["composerTop"] < g["statusTop"] and g["statusBottom"] <= g["height"]  # status on screen


def test_long_answer_keeps_newest_text_and_status_on_screen(browser, server, fake):
    fake.reset(script=_script(fake, LONG), step_delay=0.01)
    _open(browser, server)
    _send(browser, "talk a lot")
    WebDriverWait(browser, 20).until(lambda d: _scrolled_past(d.execute_script(GEOMETRY), 100))
    _assert_newest_text_visible(browser.execute_script(GEOMETRY))  # while it streams
    WebDriverWait(browser, 30).until(lambda d: _last_assistant(d).get_attribute("data-done") == "1")
    _assert_newest_text_visible(browser.execute_script(GEOMETRY))  # and when it ends
    assert browser.find_element(By.ID, "status").text == "done (stop)"


def test_transcript_stays_put_when_the_reader_scrolls_up(browser, server, fake):
    fake.reset(script=_script(fake, LONG), step_delay=0.02)
    _open(browser, server)
    _send(browser, "talk a lot")
    WebDriverWait(browser, 20).until(lambda d: d.execute_script(GEOMETRY)["scrollTop"] > 200)
    browser.execute_script('document.getElementById("log").scrollTop = 0')
    before = len(_last_assistant(browser).text)
    WebDriverWait(browser, 20).until(lambda d: len(_last_assistant(d).text) > before + 100)
    assert browser.execute_script(GEOMETRY)["scrollTop"] == 0  # new text did not yank the view
    browser.find_element(By.ID, "stop").click()
    WebDriverWait(browser, 10).until(lambda d: _last_assistant(d).get_attribute("data-done") == "1")


ICON_CHECK = """
const done = arguments[arguments.length - 1];
const link = document.querySelector('link[rel="icon"]');
if (!link) { done(null); return; }
Promise.all([fetch(link.href), fetch("/favicon.ico")])
  .then((rs) => done(rs.map((r) => [r.status, r.headers.get("content-type")])));
"""


def test_page_has_an_icon_and_loads_without_errors(browser, server, fake):
    fake.reset()
    browser.get_log("browser")  # drop what earlier tests logged
    _open(browser, server)
    answers = browser.execute_async_script(ICON_CHECK)
    assert answers is not None, "the page names no icon"
    for status, ctype in answers:
        assert status == 200 and ctype.startswith("image/svg+xml")
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == []


def test_favicon_is_served_without_a_browser(server):
    r = httpx.get(server.url + "/favicon.ico")
    assert r.status_code == 200 and r.headers["content-type"].startswith("image/svg+xml")
    assert r.content.startswith(b"<svg") and b"</svg>" in r.content
    page = httpx.get(server.url + "/").text
    icon = httpx.get(server.url + "/static/favicon.svg")
    assert 'rel="icon"' in page and icon.status_code == 200 and icon.content == r.content
