"""The attention pages in a real browser (Chromium through Playwright): the step view's
hover and click, and the explorer's link from a heatmap cell to its head's steps.

Needs the playwright package and a Chromium on the PATH (Debian: apt-get install chromium);
skipped without them, unless MT_REQUIRE_EXTRAS=1 (CI sets it) makes that a failure."""

import os
import re
import shutil

import pytest

from mt.cli.main import main


def _browser_or_skip():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    if chromium and sync_playwright:
        return chromium, sync_playwright
    missing = "chromium" if not chromium else "the playwright package"
    if os.environ.get("MT_REQUIRE_EXTRAS") == "1":
        pytest.fail(f"MT_REQUIRE_EXTRAS=1 but {missing} is missing")
    pytest.skip(f"{missing} is missing")


@pytest.fixture(scope="module")
def page():
    chromium, sync_playwright = _browser_or_skip()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            tab = browser.new_page(viewport={"width": 1400, "height": 900})
            tab.errors = []
            tab.on("pageerror", lambda e: tab.errors.append(str(e)))
            yield tab
        finally:
            browser.close()


SRC = "the big dog sees a red bird"


def test_the_step_page_shows_each_value_and_where_it_came_from(toy_run, tmp_path, page, capsys):
    out = tmp_path / "flow.html"
    args = ["attention", "--model", str(toy_run), "--src", SRC, "--explain", "--kind", "decoder", "--layer", "1"]
    assert main([*args, "--head", "1", "--query", "3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    page.goto(out.as_uri())
    assert "query 3" in page.inner_text(".steps-title")
    assert page.locator("tr.query").count() == 6  # the query's row in Q, scores, scaled, masked, weights, output

    page.hover('td[data-m="scores"][data-i="3"][data-j="1"]')
    assert page.inner_text(".steps-tip").startswith("scores[3][1] = ")
    sources = page.locator("td.source")
    d_k = int(re.search(r"\(d_k = (\d+)\)", printed).group(1))
    assert sources.count() == 2 * d_k  # Q's row 3 and K's row 1
    assert {sources.nth(i).get_attribute("data-m") for i in range(sources.count())} == {"q", "k"}

    page.hover('td[data-m="masked"][data-i="1"][data-j="4"]')
    assert "−∞" in page.inner_text(".steps-tip")  # the future is masked

    page.hover('td[data-m="weights"][data-i="3"][data-j="2"]')
    tip = page.inner_text(".steps-tip")
    value = float(tip.split(" = ")[1])
    row = printed.split("5. weights = softmax")[1].split("query 3's row")[1].splitlines()[2].split()
    assert abs(value - float(row[2])) < 1e-4  # the page's softmax is the printed, checked one

    page.click('th[data-row="5"]')  # follow another query
    assert "query 5" in page.inner_text(".steps-title")
    assert page.errors == []


def test_the_explorer_opens_the_steps_of_a_clicked_cell(toy_run, tmp_path, page):
    out = tmp_path / "explorer.html"
    assert main(["attention", "--model", str(toy_run), "--src", SRC, "--html", str(out)]) == 0
    page.goto(out.as_uri())
    page.select_option("#kind", "cross")
    page.select_option("#layer", "1")
    page.select_option("#head", "0")
    page.click('#map td[data-i="2"][data-j="4"]')
    assert page.inner_text(".steps-title").startswith("cross-attention, layer 1, head 0 — query 2")
    page.hover('td[data-m="weights"][data-i="2"][data-j="4"]')
    shown = float(page.inner_text(".steps-tip").split(" = ")[1])
    page.hover('#map td[data-i="2"][data-j="4"]')
    heatmap = float(page.inner_text("#tip").rsplit(": ", 1)[1])
    assert abs(shown - heatmap) < 1e-3  # the step view's weight is the heatmap's
    page.select_option("#head", "mean")
    page.click('#map td[data-i="0"][data-j="0"]')
    assert "choose one head" in page.inner_text("#steps")
    assert page.errors == []


def test_the_served_page_translates_completes_and_explores(toy_run, children, page):
    import json
    import subprocess
    import urllib.request

    from conftest import free_port, get, mt_cmd, wait_for

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = children([*mt_cmd("serve", "--model", str(toy_run), "--port", str(port))],
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip

    def up() -> bool:
        try:
            return get(base + "/healthz", timeout=5)["status"] == "ok"
        except OSError:
            return False

    wait_for(up, proc, "the server")
    page.goto(base + "/")
    page.wait_for_function("document.getElementById('model-info').textContent.includes('parameters')")
    page.fill("#source", SRC)
    page.click("#translate")
    page.wait_for_selector("#explorer table.heatmap")
    shown = page.input_value("#target")
    req = urllib.request.Request(base + "/v1/translate", json.dumps({"text": SRC}).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=600) as r:
        assert shown == json.loads(r.read())["translations"][0]["text"] != ""

    before = page.inner_html("#map")
    page.select_option("#layer", "1")
    assert page.inner_html("#map") != before  # another layer, another heatmap
    before = page.inner_html("#map")
    page.select_option("#head", "1")
    assert page.inner_html("#map") != before
    page.hover('#map td[data-i="0"][data-j="0"]')
    assert ": 0." in page.inner_text("#tip") or ": 1." in page.inner_text("#tip")
    assert page.locator("#stats tr.chosen").count() == 1  # the chosen head's statistics row

    page.fill("#target", "zzz qqq")
    page.evaluate("const t = document.getElementById('target'); t.setSelectionRange(7, 7)")
    page.click("#complete")
    page.wait_for_function(
        "document.getElementById('target').value.length > 7 && !document.getElementById('complete').disabled"
    )
    assert page.input_value("#target").startswith("zzz qqq")
    page.select_option("#nbest", "3")
    page.click("#translate")
    page.wait_for_function("document.querySelectorAll('#nbest-list li').length === 3")

    # split sentences (on by default): a paragraph over two lines with a blank line between comes
    # back line for line, each sentence translated as alone, as the API's split gives it
    page.select_option("#nbest", "1")
    paragraph = f"{SRC}. a cat runs!\n\n{SRC}."
    page.fill("#source", paragraph)
    page.click("#translate")
    page.wait_for_function("document.getElementById('status').textContent.includes('3 sentences')")
    body = json.dumps({"text": [f"{SRC}. a cat runs!", f"{SRC}."], "split": True}).encode()
    req = urllib.request.Request(base + "/v1/translate", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        first, second = (t["text"] for t in json.loads(r.read())["translations"])
    assert page.input_value("#target") == f"{first}\n\n{second}"
    assert page.inner_text("#attention-pair").startswith(f"sentence 1 of 3: {SRC}.")

    page.fill("#source", "\u200b")  # a zero-width space: no pieces, so an empty translation, as mt translate's
    page.click("#translate")
    page.wait_for_function("document.getElementById('status').textContent.includes('nothing to translate')")
    assert page.input_value("#target") == "" and page.is_hidden("#attention-section")
    assert page.errors == []
