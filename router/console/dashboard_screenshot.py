"""A screenshot of the Ray dashboard's Actors view with Orchard's model servers in it, for README.

    python -m router.console.dashboard_screenshot [--out docs/img/dashboard-actors.png]

Starts `make run`'s cluster and app on ports of its own (router/console/demo_cluster.py), loads three
models and unloads one (so a DEAD row shows how an unloaded instance ended), signs headless Chromium in
to the dashboard with the cluster's Ray token (Ray's POST /api/authenticate sets its cookie), takes a PNG
of the Actors view, and stops everything it started."""

import argparse
import sys
from pathlib import Path

from router.console.demo_cluster import CHROMIUM_ARGS, ROOT, chromium, demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "dashboard-actors.png")
    parser.add_argument("--models-dir", type=Path, default=ROOT / "models")
    args = parser.parse_args(argv)
    chromium()  # fail before starting anything
    from playwright.sync_api import sync_playwright

    with demo(args.models_dir.resolve(), nodes="head:1.5,mac-1:0.8") as d:
        for model, node in (("llama-10m", "mac-1"), ("all-minilm-l6-v2", "head"), ("smollm2-135m-instruct", "head")):
            d.post(f"/v1/models/{model}/load", {"node": node})
        d.post("/v1/models/all-minilm-l6-v2/unload")
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS)
            try:
                context = browser.new_context(viewport={"width": 1600, "height": 1500})
                signed_in = context.request.post(f"{d.dashboard}/api/authenticate", headers={"Authorization": f"Bearer {d.ray_token()}"})
                if not signed_in.ok:
                    raise RuntimeError(f"the dashboard refused the cluster's token: {signed_in.status}")
                page = context.new_page()
                page.set_default_timeout(60_000)
                page.goto(f"{d.dashboard}/#/actors")
                # the unloaded server's row reads DEAD once its process has exited and the dashboard has polled the GCS
                page.wait_for_selector("text=orchard:all-minilm-l6-v2@head")
                page.wait_for_selector("text=DEAD")
                args.out.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(args.out))
            finally:
                browser.close()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
