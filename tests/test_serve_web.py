"""The web page in headless Chromium (Debian `chromium` + `chromium-driver`, driven by selenium): it lists
voices, saves an uploaded voice, streams speech, and shows first-chunk latency and RTF. A screenshot is kept in
tests/artifacts/web_page.png. Skipped outside CI when the browser is absent (.ci/run installs it)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
from serve_support import quick_tts, serve
from tiny_assets import write_voice_like_wav

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


def _need_browser() -> None:
    missing = [n for n, p in (("chromium", CHROMIUM), ("chromedriver (chromium-driver)", CHROMEDRIVER)) if not p]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium (dev extra)")
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"browser test prerequisites missing in CI: {', '.join(missing)}")
        pytest.skip(f"headless browser test needs {', '.join(missing)} (apt-get install chromium chromium-driver)")


@pytest.fixture(scope="module")
def browser():
    _need_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--autoplay-policy=no-user-gesture-required", "--window-size=1000,1100", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver, script: str, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script(script)
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for: {script}")


def test_web_page_streams_and_reports(browser, tmp_path_factory) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    tts = quick_tts(tmp_path_factory)
    clip = write_voice_like_wav(tmp_path_factory.mktemp("clip") / "me.wav", 2.0)
    with serve(tts, api_key="pagekey") as srv:
        browser.get(srv.url + "/")
        browser.find_element(By.CSS_SELECTOR, "details summary").click()
        browser.find_element(By.ID, "api-key").send_keys("pagekey")
        browser.execute_script("loadVoices()")
        wait_for(browser, "return window.vocalisStats.voices && window.vocalisStats.voices.includes('default')")

        # save a voice from an uploaded clip; it becomes selectable
        browser.find_element(By.ID, "voice-name").send_keys("web_voice")
        browser.find_element(By.ID, "voice-file").send_keys(str(clip))
        browser.find_element(By.ID, "voice-text").send_keys("hello there")
        browser.find_element(By.ID, "create-voice").click()
        wait_for(browser, "return document.getElementById('voice-status').textContent.startsWith('saved')")
        assert Select(browser.find_element(By.ID, "voice")).first_selected_option.get_attribute("value") == "web_voice"

        text = browser.find_element(By.ID, "text")
        text.clear()
        text.send_keys("Hello from the browser. It streams as it speaks.")
        browser.find_element(By.ID, "seed").send_keys("3")
        browser.find_element(By.ID, "speak").click()
        stats = wait_for(browser, "const s = window.vocalisStats; return (s.status === 'done' || s.error) && s;")
        assert stats["status"] == "done", stats
        assert stats["firstChunkMs"] > 0 and stats["rtf"] > 0 and stats["audioSeconds"] > 0 and stats["chunks"] >= 1
        assert stats["bytes"] % 2 == 0
        assert stats["audioContext"], "Web Audio is unavailable in this Chromium"
        assert stats["playedSeconds"] == pytest.approx(stats["audioSeconds"], rel=1e-6)  # all of it was scheduled
        shown = browser.find_element(By.ID, "first-chunk").text
        assert float(shown) > 0 and float(browser.find_element(By.ID, "rtf").text) > 0
        assert browser.find_element(By.ID, "player").get_attribute("src").startswith("blob:")
        ARTIFACTS.mkdir(exist_ok=True)
        assert browser.save_screenshot(str(ARTIFACTS / "web_page.png"))

        # a bad request shows the server's message
        Select(browser.find_element(By.ID, "voice")).select_by_value("alloy")
        browser.find_element(By.ID, "speed").clear()
        browser.find_element(By.ID, "speed").send_keys("9")
        browser.find_element(By.ID, "speak").click()
        wait_for(browser, "return window.vocalisStats.error")
        assert "speed" in browser.find_element(By.ID, "status").text
