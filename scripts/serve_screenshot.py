"""The README's picture of the page that ``mt serve`` serves.

    python scripts/serve_screenshot.py [--model runs/multi30k_cpu] [--out docs/images/serve.png]

Starts ``mt serve`` on a free loopback port, opens its page in headless
Chromium (the system's: Debian's ``chromium`` package, driven by Playwright),
translates a sentence with 3-best, picks a cross-attention layer, and saves a
screenshot of the whole page. The server is stopped however the script ends.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

SENTENCE = "A man in an orange hat starring at something."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(base: str, server: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            with urllib.request.urlopen(base + "/healthz", timeout=5):
                return
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                sys.exit("mt serve did not start")
            time.sleep(0.2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="runs/multi30k_cpu", help="run directory (default runs/multi30k_cpu)")
    p.add_argument("--out", type=Path, default=Path("docs/images/serve.png"))
    p.add_argument("--layer", default="2", help="cross-attention layer to show (default 2)")
    args = p.parse_args()

    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("needs a system Chromium on the PATH (Debian: apt-get install chromium)")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "mt", "serve", "--model", args.model, "--port", str(port)],
                              stdout=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_until_up(base, server)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1200, "height": 900}, device_scale_factor=1)
            page.goto(base + "/")
            page.wait_for_function("document.getElementById('model-info').textContent.includes('parameters')")
            page.fill("#source", SENTENCE)
            page.select_option("#nbest", "3")
            page.click("#translate")
            page.wait_for_function("document.querySelectorAll('#nbest-list li').length === 3")
            page.wait_for_selector("#explorer table.heatmap")
            page.select_option("#kind", "cross")
            page.select_option("#layer", args.layer)
            page.hover('#map td[data-i="1"][data-j="1"]')
            args.out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(args.out), full_page=True)
            browser.close()
    finally:
        server.terminate()  # mt serve stops gracefully on SIGTERM
        server.wait(timeout=60)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
