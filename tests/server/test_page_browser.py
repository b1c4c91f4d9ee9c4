"""The server's page at / in a real headless browser (Debian's chromium and chromedriver, driven by selenium;
no browser is downloaded): it loads and shows the model, a prompt streams into coloured token spans with
live tokens and τ, the metrics table fills, and the infill mode writes the middle between the code around
the cursor. `.ci/run` installs the browser and sets SPECSTACK_REQUIRE_BROWSER=1, so there a missing browser
fails the test instead of skipping it. SPECSTACK_SCREENSHOT=DIR keeps screenshots of both modes."""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from server.servers import Server

ORIGINS = {"target", "draft", "draft2", "context"}
TIMEOUT = 60


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        why = "Debian's chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)"
        if os.environ.get("SPECSTACK_REQUIRE_BROWSER"):
            pytest.fail(why)
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = chromium
    # as root on a closed network: no sandbox, no GPU, no background connections (each would be refused)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1280,900",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        options.add_argument(flag)
    web = webdriver.Chrome(service=Service(driver), options=options)
    web.set_page_load_timeout(TIMEOUT)
    yield web
    web.quit()


def wait_for(web: object, condition, timeout: float = TIMEOUT):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(web, timeout).until(lambda _: condition())


def by_id(web, name: str):
    from selenium.webdriver.common.by import By

    return web.find_element(By.ID, name)


def spans(web, css: str) -> list[tuple[str, str]]:
    from selenium.webdriver.common.by import By

    return [(s.get_attribute("textContent"), s.get_attribute("class")) for s in web.find_elements(By.CSS_SELECTOR, css)]


def shoot(web, name: str) -> None:
    where = os.environ.get("SPECSTACK_SCREENSHOT")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        web.save_screenshot(str(Path(where) / f"{name}.png"))


def run(web) -> str:
    """Click Generate and wait until the page says it is done; its state line."""
    by_id(web, "generate").click()
    return wait_for(web, lambda: (s := by_id(web, "stat-state").text).startswith(("done", "failed")) and s)


def test_page_streams_a_prompt_in_coloured_tokens_and_fills_a_middle(browser, fim_server: Server) -> None:
    web = browser
    web.get(fim_server.root + "/")
    wait_for(web, lambda: by_id(web, "model").text == fim_server.model)
    assert "speculation" in by_id(web, "method").text
    # completion: the text arrives as spans, one class per origin, and the stats move
    by_id(web, "prompt").clear()
    by_id(web, "prompt").send_keys("def mean(values):")
    by_id(web, "max-tokens").clear()
    by_id(web, "max-tokens").send_keys("24")
    state = run(web)
    assert state.startswith("done"), by_id(web, "error").text
    pieces = spans(web, "#output span")
    assert pieces and {cls for _, cls in pieces} <= ORIGINS
    text = "".join(t for t, _ in pieces)
    assert text == by_id(web, "output").get_attribute("textContent")
    assert int(by_id(web, "stat-tokens").text) >= 1 and float(by_id(web, "stat-tau").text) >= 1.0
    wait_for(web, lambda: "tokens generated" in by_id(web, "metrics").text)
    shoot(web, "completion")
    # infill: the middle between the prefix and the suffix, shown greyed around it
    by_id(web, "mode-infill").click()
    assert by_id(web, "prefix").is_displayed() and not by_id(web, "prompt").is_displayed()
    prefix, suffix = by_id(web, "prefix").get_attribute("value"), by_id(web, "suffix").get_attribute("value")
    state = run(web)
    assert state.startswith("done"), by_id(web, "error").text
    middle = spans(web, "#middle span")
    assert middle and {cls for _, cls in middle} <= ORIGINS
    whole = by_id(web, "output").get_attribute("textContent")
    assert whole == prefix + "".join(t for t, _ in middle) + suffix
    shoot(web, "infill")


def test_page_shows_a_refused_request(browser, tiny_server: Server) -> None:
    """The default tiny model has no FIM tokens: the page says why instead of hanging."""
    web = browser
    web.get(tiny_server.root + "/")
    wait_for(web, lambda: by_id(web, "model").text == tiny_server.model)
    by_id(web, "mode-infill").click()
    assert run(web) == "failed"
    assert "Infill is not supported" in by_id(web, "error").text
