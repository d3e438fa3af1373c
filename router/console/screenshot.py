"""Screenshots of the console (/ui) for README and docs/console.md.

    python -m router.console.screenshot [--out docs/images]

Starts `make run`'s cluster and app on ports of its own (router/console/demo_cluster.py), places a few
models the way a day on it would (one copied to a node whose store lacks it first), loads a model onto
a node that must evict another for it, then opens the page in headless Chromium and writes:
console-overview.png (the whole page), console-what-if.png (a what-if and the confirmation before a
load) and console-story.png (the story, the eviction among it). Stops everything it started."""

import argparse
import sys
from pathlib import Path

from router.console.demo_cluster import CHROMIUM_ARGS, ROOT, chromium, demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    parser.add_argument("--models-dir", type=Path, default=ROOT / "models")
    args = parser.parse_args(argv)
    chromium()  # fail before starting anything
    from playwright.sync_api import sync_playwright

    args.out.mkdir(parents=True, exist_ok=True)
    with demo(args.models_dir.resolve()) as d:
        d.post("/v1/models/smollm2-135m-instruct/load", {"node": "head"})
        d.post("/v1/models/all-minilm-l6-v2/load", {"node": "head"})
        d.post("/v1/models/llama-10m/load", {"node": "mac-1"})  # mac-1's store is empty: copied from the head first
        d.post("/v1/models/whisper-tiny-en/pull", {"nodes": ["mac-2"]})
        answer = d.when_placeable("whisper-tiny-en", "mac-1")  # llama-10m must make room, once it is no longer young
        print(f"what-if whisper-tiny-en on mac-1: {answer['words']}")
        d.post("/v1/models/whisper-tiny-en/load", {"node": "mac-1"})
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1440, "height": 1000}, device_scale_factor=1)
                page.set_default_timeout(60_000)
                page.goto(d.base + "/ui")
                page.wait_for_selector("#live.on")
                page.wait_for_selector("#story li[data-kind='evicted']")
                page.wait_for_selector("#instances tr[data-model='whisper-tiny-en']")
                page.screenshot(path=str(args.out / "console-overview.png"), full_page=True)
                page.select_option("#whatif-model", "llama-10m")
                page.select_option("#whatif-node", "head")
                page.click("#whatif-go")
                page.wait_for_selector("#whatif-result:not([hidden])")
                page.click("#act-load")
                page.wait_for_selector("#confirm:not([hidden])")
                page.locator("#act").screenshot(path=str(args.out / "console-what-if.png"))
                page.locator("#story-section").screenshot(path=str(args.out / "console-story.png"))
            finally:
                browser.close()
    for name in ("console-overview.png", "console-what-if.png", "console-story.png"):
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
