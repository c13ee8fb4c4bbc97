"""The incident view in a real browser (issue 37): Debian's chromium, driven by Debian's
chromium-driver through Selenium, loads /v1/incidents/{id}/view from a real ``kvguard
sidecar`` process that watched the short-transfer incident (the engine-side probes write it
into the rings: tests/sidecar/test_incident_view.py), and checks what a person sees: the
reader's row, the exposed tenants, the short transfer, the drawn timeline. Without the
token the browser gets the API's 401, not the page. A screenshot is kept under the test's
tmp dir, and copied to $KVGUARD_TEST_ARTIFACTS when that is set.

Skipped only when chromium or chromedriver is not installed (`make apt` installs both)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.sidecar.reliability.sidecar_under_test import stop_all, wait_for
from tests.sidecar.test_incident_view import the_incident
from tests.support.browser import MISSING, available, browser, keep_screenshot

KVGUARD = Path(sys.executable).parent / "kvguard"
TOKEN = "browser-test-token"

pytestmark = pytest.mark.skipif(not available(), reason=MISSING)


def test_the_incident_view_in_chromium_from_a_live_sidecar(tmp_path):
    from selenium.webdriver.common.by import By

    from tests.sidecar.reliability.sidecar_under_test import free_port

    ring_dir, log = tmp_path / "rings", tmp_path / "sidecar.log"
    ring_dir.mkdir()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    port = free_port()
    procs: list = []
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    drivers = []
    try:
        with open(log, "w") as out:
            procs.append(
                subprocess.Popen(
                    [
                        str(KVGUARD),
                        "sidecar",
                        "--ring-dir",
                        str(ring_dir),
                        "--listen",
                        f"127.0.0.1:{port}",
                        "--api-token-file",
                        str(token_file),
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
        engines = the_incident(ring_dir)  # noqa: F841 -- the probes, as an engine's hooks write them (kept open)

        def incident():
            r = httpx.get(f"{base}/v1/incidents", params={"kind": "unwritten_read"}, headers=auth, timeout=2)
            found = r.json()["incidents"] if r.status_code == 200 else []
            related = httpx.get(f"{base}/v1/incidents", params={"kind": "transfer_size_mismatch"}, headers=auth)
            return found[0] if found and related.json()["incidents"] else None

        inc = wait_for("the unwritten_read incident", incident, 20, procs[0], log)
        url = f"{base}/v1/incidents/{inc['id']}/view"

        driver = browser(auth)
        drivers.append(driver)
        driver.get(url)
        assert driver.title == f"kvguard unwritten_read {inc['id']}"
        reader_row = driver.find_element(By.ID, "reader-row").text
        assert "reader" in reader_row and "r-initech" in reader_row and "initech" in reader_row
        assert driver.find_element(By.ID, "tenants-exposed").text == "Tenants whose KV was exposed: acme, globex"
        exposed = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "tr.exposed-row")]
        assert any("r-acme" in t and "acme" in t for t in exposed)
        assert any("r-globex" in t and "globex" in t for t in exposed)
        assert "prefill sent 1 of 16 reserved tokens (1 of 4 pages)" in driver.find_element(By.ID, "transfer").text
        assert "read 3 pages reserved for it that nothing wrote for it" in driver.find_element(By.ID, "summary").text
        # the timeline is drawn: a visible SVG with the page rows and their spans
        svg = driver.find_element(By.CSS_SELECTOR, "svg[aria-label='page ownership timeline']")
        assert svg.is_displayed() and svg.size["width"] > 800 and svg.size["height"] > 100
        labels = {t.text for t in svg.find_elements(By.TAG_NAME, "text")}
        assert {"reader", "page 2", "page 3", "page 4"} <= labels
        assert len(svg.find_elements(By.TAG_NAME, "rect")) > 10
        # the browser ran nothing and fetched nothing but the page (CSP: default-src 'none')
        fetched = driver.execute_script("return performance.getEntriesByType('resource').length")
        assert fetched == 0
        keep_screenshot(driver, tmp_path / "incident-view.png")
        # the list links to it
        driver.get(f"{base}/v1/incidents/view")
        driver.find_element(By.LINK_TEXT, inc["id"]).click()
        assert driver.current_url == url

        # without the token: the API's 401, not the page
        bare = browser()
        drivers.append(bare)
        bare.get(url)
        body = bare.find_element(By.TAG_NAME, "body").text
        assert "missing or wrong bearer token" in body and "initech" not in body
        assert httpx.get(url, timeout=2).status_code == 401
    finally:
        for d in drivers:
            d.quit()
        stop_all(procs)
