"""Screenshots of the server's page (GET /) for the docs: a running `specstack serve` at URL, Debian's
chromium driven by selenium (as tests/server/test_page_browser.py drives it), one completion and one infill
request typed into the page, each captured once it is done.

    python benchmarks/fim/screenshot.py http://127.0.0.1:8000 docs/images
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

COMPLETION = 'def parse_duration(text: str) -> float:\n    """Seconds in "1h30m", "45s" or "2m5s"."""\n'
PREFIX = ("import re\n\n\ndef slugify(title: str) -> str:\n"
          '    """A URL slug: lowercase words joined by dashes."""\n    ')
SUFFIX = "\n\n\nassert slugify(\"Hello, World!\") == \"hello-world\"\n"


def main() -> int:
    url, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    options = Options()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1300,1000", f"--user-data-dir={tempfile.mkdtemp()}"):
        options.add_argument(flag)
    web = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    wait = WebDriverWait(web, 600)
    try:
        web.get(url + "/")
        wait.until(lambda w: w.find_element(By.ID, "model").text not in ("", "…"))

        def run(name: str) -> None:
            web.find_element(By.ID, "generate").click()
            wait.until(lambda w: w.find_element(By.ID, "stat-state").text.startswith(("done", "failed")))
            web.save_screenshot(str(out / f"page-{name}.png"))
            print(name, web.find_element(By.ID, "stat-state").text, web.find_element(By.ID, "stat-tau").text)

        def fill(field: str, text: str) -> None:
            web.execute_script("document.getElementById(arguments[0]).value = arguments[1];", field, text)

        fill("prompt", COMPLETION)
        fill("max-tokens", "96")
        run("completion")
        web.find_element(By.ID, "mode-infill").click()
        fill("prefix", PREFIX)
        fill("suffix", SUFFIX)
        run("infill")
    finally:
        web.quit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
