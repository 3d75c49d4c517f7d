"""Open every page of the built book in headless Chromium and check what a reader would see.

For each page it fails when
  - math is left as raw TeX (a `\\(`, `\\[` or `$$` outside code, or a math element MathJax did
    not typeset),
  - an image is broken or an internal link (or its #anchor) points nowhere,
  - a script, stylesheet or image is loaded from another host (the book must work offline),
  - the page carries widget state but no widget was rendered,
  - a cell shows an error output or a traceback (except cells tagged `raises-exception`: the
    exercises' deliberately wrong starting answers),
and it saves a screenshot of every page under _build/screenshots/.

The site is served on 127.0.0.1 only. Chromium and ChromeDriver come from the system (Debian's
`chromium` and `chromium-driver`; `.ci/run` installs them). When they are missing the check
fails, unless it was told to skip with `--skip-if-no-browser` (`make test BROWSER_CHECK=skip`);
in CI (CI=true) a missing browser is a failure even then.
"""

import argparse
import functools
import http.server
import json
import os
import re
import shutil
import sys
import threading
import time
from pathlib import Path
from urllib.parse import unquote, urldefrag, urlparse

SKIP_PAGES = {"genindex.html", "search.html", "py-modindex.html"}
BROWSERS = ["chromium", "chromium-browser", "google-chrome", "google-chrome-stable"]
DRIVERS = ["chromedriver"]

# Runs in the page after it loaded: waits for MathJax, then reports what the reader sees.
INSPECT_JS = r"""
const done = arguments[arguments.length - 1];
const ready = (window.MathJax && MathJax.startup && MathJax.startup.promise) || Promise.resolve();
const settle = () => new Promise(r => setTimeout(r, 300));
ready.then(settle).then(() => {
  const isCode = el => el.closest('pre, code, .highlight, script, style, textarea');
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  const rawMath = [];
  while (walker.nextNode()) {
    const node = walker.currentNode;
    if (node.parentElement && !isCode(node.parentElement) && /\\\(|\\\[|\$\$/.test(node.textContent)) {
      rawMath.push(node.textContent.trim().slice(0, 80));
    }
  }
  const untypeset = [...document.querySelectorAll('.math')]
    .filter(el => !el.querySelector('mjx-container') && !el.closest('mjx-container'))
    .map(el => el.textContent.trim().slice(0, 80));
  const images = [...document.images].map(img => ({src: img.currentSrc || img.src,
    ok: img.complete && img.naturalWidth > 0}));
  const links = [...document.querySelectorAll('a[href]')].map(a => a.href);
  const resources = [...document.querySelectorAll('script[src], link[rel~="stylesheet"][href], img[src]')]
    .map(el => el.src || el.href);
  const widgetState = !!document.querySelector('script[type="application/vnd.jupyter.widget-state+json"]');
  const widgets = document.querySelectorAll('.jupyter-widgets, .widget-container, .widget-slider').length;
  const expected = el => el.closest('.tag_raises-exception');
  const errors = [...document.querySelectorAll('.output.traceback, .output.error')]
    .filter(el => !expected(el)).map(el => el.textContent.trim().slice(0, 120));
  const tracebacks = [...document.querySelectorAll('.cell_output')]
    .filter(el => !expected(el) && /Traceback \(most recent call last\)/.test(el.textContent))
    .map(el => el.textContent.trim().slice(0, 120));
  done({rawMath, untypeset, images, links, resources, widgetState, widgets, errors, tracebacks,
        typeset: document.querySelectorAll('mjx-container').length});
}).catch(err => done({error: String(err)}));
"""


def find(names):
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    return None


def serve(root: Path):
    handler = functools.partial(QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def start_browser(browser: str, driver: str, profile: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in [
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--window-size=1280,1600",
    ]:
        options.add_argument(flag)
    session = webdriver.Chrome(service=Service(executable_path=driver), options=options)
    session.set_script_timeout(60)
    session.set_page_load_timeout(60)
    return session


def anchors_of(path: Path) -> set[str]:
    return set(re.findall(r'\bid="([^"]+)"', path.read_text(errors="replace")))


def check_link(site: Path, base: str, href: str, anchor_cache: dict) -> str | None:
    """Return a problem description if an internal link is broken, else None."""
    url, fragment = urldefrag(href)
    parsed = urlparse(url)
    if not url.startswith(base):
        return None  # external links are not followed (the build machine may be offline)
    target = site / unquote(parsed.path.lstrip("/"))
    if target.is_dir():
        target = target / "index.html"
    if not target.exists():
        return f"broken link {href}"
    if fragment and target.suffix == ".html":
        if target not in anchor_cache:
            anchor_cache[target] = anchors_of(target)
        if unquote(fragment) not in anchor_cache[target]:
            return f"missing anchor {href}"
    return None


def check_site(site: Path, shots: Path, skip_if_no_browser: bool = False) -> dict:
    browser, driver = find(BROWSERS), find(DRIVERS)
    if not browser or not driver:
        message = "Chromium or ChromeDriver not found (install Debian's chromium and chromium-driver)"
        if os.environ.get("CI"):
            raise SystemExit(f"browser check: {message}; in CI this is a failure, not a skip")
        if not skip_if_no_browser:
            raise SystemExit(
                f"browser check: {message}. To build and test without it, pass --skip-if-no-browser "
                "(make test BROWSER_CHECK=skip)"
            )
        print(f"browser check SKIPPED (--skip-if-no-browser): {message}")
        return {"skipped": message, "pages": {}}

    pages = []
    for path in sorted(site.rglob("*.html")):
        parts = path.relative_to(site).parts
        if (
            parts[0] in ("_static", "_sources")
            or path.name in SKIP_PAGES
            or any(x.startswith(".") for x in parts)
        ):
            continue
        pages.append(path)
    if not pages:
        raise SystemExit(f"browser check: no pages under {site}")
    shots.mkdir(parents=True, exist_ok=True)
    server = serve(site)
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    profile = Path(os.environ.get("TMPDIR", "/tmp")) / f"kda-edu-chromium-{os.getpid()}"
    session = start_browser(browser, driver, profile)
    results, anchor_cache = {}, {}
    try:
        for page in pages:
            rel = page.relative_to(site).as_posix()
            start = time.perf_counter()
            session.get(base + rel)
            seen = session.execute_async_script(INSPECT_JS)
            problems = []
            if "error" in seen:
                problems.append(f"page script failed: {seen['error']}")
            else:
                problems += [f"raw TeX left in text: {t!r}" for t in seen["rawMath"]]
                problems += [f"math not typeset: {t!r}" for t in seen["untypeset"]]
                problems += [f"broken image {i['src']}" for i in seen["images"] if not i["ok"]]
                problems += [
                    f"loads from another host: {r}"
                    for r in seen["resources"]
                    if not r.startswith((base, "data:"))
                ]
                problems += [f"error output in a cell: {t!r}" for t in seen["errors"]]
                problems += [f"traceback in a cell's output: {t!r}" for t in seen["tracebacks"]]
                if seen["widgetState"] and seen["widgets"] == 0:
                    problems.append("page has widget state but no widget rendered")
                for href in sorted(set(seen["links"])):
                    problem = check_link(site, base, href, anchor_cache)
                    if problem:
                        problems.append(problem)
            shot = shots / (rel.replace("/", "__").removesuffix(".html") + ".png")
            height = session.execute_script("return document.documentElement.scrollHeight")
            session.set_window_size(1280, min(max(int(height), 800), 16000))
            session.save_screenshot(str(shot))
            session.set_window_size(1280, 1600)
            results[rel] = {
                "problems": problems,
                "math_typeset": seen.get("typeset", 0),
                "images": len(seen.get("images", [])),
                "widgets": seen.get("widgets", 0),
                "screenshot": str(shot),
                "seconds": round(time.perf_counter() - start, 2),
            }
            status = "ok" if not problems else f"{len(problems)} problem(s)"
            print(
                f"  {rel}: {status} (math {results[rel]['math_typeset']}, images {results[rel]['images']}, "
                f"widgets {results[rel]['widgets']})"
            )
            for problem in problems:
                print(f"      - {problem}")
    finally:
        session.quit()
        server.shutdown()
        shutil.rmtree(profile, ignore_errors=True)
    return {"pages": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path, help="the built HTML book, e.g. _build/html")
    parser.add_argument("--screenshots", type=Path, default=Path("_build/screenshots"))
    parser.add_argument("--report", type=Path, help="write the results as JSON here")
    parser.add_argument(
        "--skip-if-no-browser",
        action="store_true",
        help="skip (instead of failing) without Chromium; not in CI",
    )
    args = parser.parse_args()
    if not (args.site / "index.html").exists():
        raise SystemExit(f"browser check: {args.site}/index.html not found; build the book first")
    print(f"browser check of {args.site}")
    report = check_site(args.site, args.screenshots, args.skip_if_no_browser)
    failed = [page for page, r in report["pages"].items() if r["problems"]]
    report["passed"] = len(report["pages"]) - len(failed)
    report["failed"] = len(failed)
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(report, indent=2))
    if "skipped" not in report:
        print(f"browser: {report['passed']} passed, {report['failed']} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
