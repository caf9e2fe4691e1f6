"""Screenshots of the dashboard's main pages, for docs/ (README shows one).

    python docs/screenshots.py --url http://127.0.0.1:8100 --token-file .tracetrain/admin-token

Logs in through the form in headless Chromium (Debian's ``chromium``, driven by Playwright),
then saves docs/dashboard-{overview,trajectory,group,training,adapters}.png. Point it at a
proxy with data in it: the demo's (``make demo``) is what the committed images show.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from playwright.sync_api import sync_playwright

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8100", help="the proxy's root URL (default %(default)s)")
    p.add_argument("--token-file", type=Path, required=True, help="a file holding the admin token")
    p.add_argument("--out", type=Path, default=Path(__file__).parent, help="where the images go (default docs/)")
    p.add_argument("--chromium", default="/usr/bin/chromium", help="the browser binary (default %(default)s)")
    args = p.parse_args()
    token = args.token_file.read_text().strip()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=args.chromium, args=FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 860}, device_scale_factor=1)
        page.goto(f"{args.url}/admin/ui/login")
        page.fill("#token", token)
        page.click("button[type=submit]")
        page.wait_for_url(f"{args.url}/admin")

        def shot(name: str, full_page: bool = False) -> None:
            path = args.out / f"dashboard-{name}.png"
            page.screenshot(path=path, full_page=full_page)
            print(f"wrote {path}")

        shot("overview")
        page.goto(f"{args.url}/admin/ui/training")
        shot("training")
        page.goto(f"{args.url}/admin/ui/adapters")
        shot("adapters")
        page.goto(f"{args.url}/admin/ui/trajectories?rewarded=true")
        page.locator("table tbody tr td a.mono").first.click()
        page.wait_for_load_state()
        shot("trajectory")
        groups = page.request.get(f"{args.url}/admin/groups?state=trained&limit=200").json()["data"]
        varied = max(groups, key=lambda g: g["reward_std"] or 0.0)  # one whose advantages say something
        page.goto(f"{args.url}/admin/ui/groups/{varied['id']}")
        shot("group")
        browser.close()


if __name__ == "__main__":
    main()
