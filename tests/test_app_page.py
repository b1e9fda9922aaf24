"""The web page at `/` in a real headless Chromium (Debian's `chromium`, driven by Playwright for
Python; nothing downloaded at test time) against a real `mlxr serve` of the bundled model, with
a second model in a temporary Hugging Face cache and the fake Hub (tests/fake_hub.py) for search
and pulls: load the page, stream an answer, stop one midway, switch models, see the server's
refusal, the models view (loaded, local, Hub search, a pull with live progress), and with
--api-key the page asking for the key once. Screenshots go to the artifacts directory printed
by the tests ($MLXR_ARTIFACTS, else a pytest temporary directory).

CI (.ci/run) installs chromium when it is missing: a missing browser fails these tests. Locally
MLXR_SKIP_BROWSER=1 skips them."""

import json
import os
import shutil
from pathlib import Path

import httpx
import pytest
from fake_hub import FakeHub
from test_model_manager import cache_model, hub_env
from test_server_helpers import BUNDLED, Server

OTHER = "mlxr-test/story-b"
PULLABLE = "mlxr-test/stories-pull"
KEY = "page-test-key-0123"


def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("no chromium on PATH: install Debian's `chromium` package (.ci/run does), or "
                    "set MLXR_SKIP_BROWSER=1 to skip the page tests locally")
    return path


@pytest.fixture(scope="module")
def browser():
    if os.environ.get("MLXR_SKIP_BROWSER") == "1":
        pytest.skip("MLXR_SKIP_BROWSER=1: the page tests need Chromium")
    from playwright.sync_api import sync_playwright

    exe = chromium_path()
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, headless=True,
                              args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    d = Path(os.environ["MLXR_ARTIFACTS"]) if os.environ.get("MLXR_ARTIFACTS") else \
        tmp_path_factory.mktemp("page-screenshots")
    d.mkdir(parents=True, exist_ok=True)
    print(f"\npage screenshots: {d}")
    return d


@pytest.fixture(scope="module")
def hub():
    h = FakeHub().start()
    h.add_dir(PULLABLE, BUNDLED)
    yield h
    h.stop()


@pytest.fixture(scope="module")
def server(hub, tmp_path_factory):
    env = hub_env(tmp_path_factory.mktemp("hf"))
    env.pop("HF_HUB_OFFLINE")
    env.update(HF_ENDPOINT=hub.url, HF_HUB_DISABLE_PROGRESS_BARS="1")
    cache_model(env, OTHER, BUNDLED)
    s = Server(BUNDLED.name, "--allow-pull", "--keep-alive", "60s", env=env)
    yield s
    s.stop()


class Console:
    """The page's console errors and failed requests (a CSP violation shows up here)."""

    def __init__(self, page):
        self.errors: list[str] = []
        page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        page.on("pageerror", lambda e: self.errors.append(str(e)))


def open_page(browser, url: str):
    ctx = browser.new_context(viewport={"width": 1100, "height": 800})
    page = ctx.new_page()
    page.set_default_timeout(120_000)  # a shared CPU runs the model under Triton's interpreter
    console = Console(page)
    page.goto(url + "/")
    return ctx, page, console


def wait_ready(page):
    page.wait_for_selector("#model[data-ready='1']")


def answers(page) -> list:
    return page.locator(".msg.assistant")


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def done_count(page) -> int:
    return int(page.get_attribute("#messages", "data-done") or 0)


def set_max_tokens(page, n: int | str) -> None:
    if page.get_attribute("#settings", "open") is None:
        page.click("#settings summary")
    page.fill("#max_tokens", str(n))
    page.dispatch_event("#max_tokens", "change")


def test_page_headers_and_files(server):
    r = httpx.get(server.url + "/")
    csp = r.headers["content-security-policy"]
    assert r.status_code == 200 and "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert "<script>" not in r.text and "cdn" not in r.text.lower()
    for name in ("app.js", "markdown.js", "style.css"):
        assert httpx.get(server.url + "/static/" + name).status_code == 200
    assert httpx.get(server.url + "/static/..%2Fapp.py").status_code == 404
    assert httpx.get(server.url + "/static/nope.js").status_code == 404


def test_chat_streams_then_completes(browser, server, artifacts):
    ctx, page, console = open_page(browser, server.url)
    wait_ready(page)
    assert page.input_value("#model") == BUNDLED.name
    set_max_tokens(page, 100)
    send(page, "Once upon a time")
    page.wait_for_selector("#stop:not([hidden])")
    # tokens arrive while the answer is still running (the stop button is up)
    lengths = []
    while not page.is_hidden("#stop") and len(lengths) < 200:
        lengths.append(len(answers(page).last.locator(".content").inner_text()))
        page.wait_for_timeout(20)
    streamed = [n for n in lengths if n > 0]
    assert len(set(streamed)) >= 2, lengths  # seen growing before the end
    page.wait_for_selector("#messages[data-done='1']", state="attached")
    last = answers(page).last
    assert last.locator(".content").inner_text().strip()
    assert "tok/s" in last.locator(".stats").inner_text()
    page.screenshot(path=artifacts / "chat-answer.png", full_page=True)
    # the history survives a reload (localStorage)
    page.reload()
    wait_ready(page)
    assert page.locator(".msg.user").count() == 1 and answers(page).count() == 1
    assert console.errors == []
    ctx.close()


def test_stop_midway(browser, server, artifacts):
    ctx, page, console = open_page(browser, server.url)
    wait_ready(page)
    page.click("#new-chat")
    set_max_tokens(page, 480)
    send(page, "Once upon a time")
    page.wait_for_selector("#stop:not([hidden])")
    while len(answers(page).last.locator(".content").inner_text()) <= 3:
        page.wait_for_timeout(10)
    page.click("#stop")
    page.wait_for_selector("#stop", state="hidden")
    stats = answers(page).last.locator(".stats").inner_text()
    assert stats.startswith("stopped"), stats
    assert answers(page).last.locator(".content").inner_text().strip()
    page.screenshot(path=artifacts / "chat-stopped.png", full_page=True)
    # the server let go of it: nothing running
    page.wait_for_timeout(300)
    assert server.metric("mlxr_num_requests_running") == 0
    assert console.errors == []
    ctx.close()


def test_switch_models_and_refusal(browser, server, artifacts):
    ctx, page, console = open_page(browser, server.url)
    wait_ready(page)
    page.click("#new-chat")
    page.select_option("#model", OTHER)
    set_max_tokens(page, 8)
    send(page, "Once upon a time")
    page.wait_for_selector("#messages[data-done='1']", state="attached")
    assert "tok/s" in answers(page).last.locator(".stats").inner_text()
    loaded = [m["name"] for m in httpx.get(server.url + "/api/ps").json()["models"]]
    assert OTHER in loaded and BUNDLED.name in loaded
    # the server refuses: more tokens than the model's context
    set_max_tokens(page, 100000)
    send(page, "Once upon a time")
    page.wait_for_selector("#error:not([hidden])")
    assert "context" in page.inner_text("#error")
    assert "context" in answers(page).last.locator(".stats").inner_text()
    page.screenshot(path=artifacts / "chat-error.png", full_page=True)
    assert all("400" in e for e in console.errors), console.errors  # the refused request only
    ctx.close()


def test_markdown_is_escaped_and_reasoning_folded(browser, server, artifacts):
    ctx, page, console = open_page(browser, server.url)
    wait_ready(page)
    hostile = ("# Title\n**bold** `a<b`\n<img src=x onerror=\"window.pwned=1\">\n\n```python\n"
               "print('<script>')\n```\n[x](javascript:alert(1)) [ok](https://example.org)")
    history = [{"role": "user", "content": "<b>hi</b>"},
               {"role": "assistant", "content": hostile, "reasoning": "thinking *hard*",
                "stats": "5 tokens, 50.0 tok/s"}]
    page.evaluate("h => localStorage.setItem('mlxr.history', JSON.stringify(h))", history)
    page.reload()
    wait_ready(page)
    msg = answers(page).last
    assert msg.locator("img").count() == 0 and msg.locator("script").count() == 0
    assert page.evaluate("window.pwned") is None
    assert msg.locator("h1").inner_text() == "Title"
    assert msg.locator("pre code.language-python").inner_text() == "print('<script>')"
    assert msg.locator("a").count() == 1
    assert msg.locator("a").get_attribute("href") == "https://example.org"
    details = msg.locator("details")
    assert details.count() == 1 and details.get_attribute("open") is None
    assert page.locator(".msg.user").inner_text() == "<b>hi</b>"
    page.screenshot(path=artifacts / "chat-markdown.png", full_page=True)
    assert console.errors == []
    ctx.close()


def test_models_view_search_and_pull(browser, server, artifacts):
    ctx, page, console = open_page(browser, server.url)
    wait_ready(page)
    page.click("#tab-models")
    page.wait_for_selector("#loaded tbody tr")
    assert BUNDLED.name in page.inner_text("#loaded")
    assert OTHER in page.inner_text("#local")
    assert page.is_hidden("#pull-note")  # --allow-pull
    page.fill("#search", "stories")
    page.click("#search-form button")
    row = page.locator("#hub tr", has_text=PULLABLE)
    row.wait_for()
    row.locator("button").click()
    page.locator("#hub tr", has_text="success").wait_for()
    progress = row.locator("progress")
    assert progress.evaluate("p => p.value === p.max && p.max > 1000")
    page.locator(f"#model option[value='{PULLABLE}']").wait_for(state="attached")
    page.screenshot(path=artifacts / "models-view.png", full_page=True)
    # stop the bundled model from the page (Ollama's keep_alive 0)
    page.locator("#loaded tr", has_text=BUNDLED.name).locator("button").click()
    page.locator("#loaded tr", has_text=BUNDLED.name).wait_for(state="detached")
    assert BUNDLED.name not in [m["name"] for m in httpx.get(server.url + "/api/ps").json()[
        "models"]]
    assert console.errors == []
    ctx.close()


def test_api_key_is_asked_once(browser, artifacts):
    s = Server(BUNDLED.name, "--api-key", KEY)
    try:
        ctx, page, console = open_page(browser, s.url)
        page.wait_for_selector("#keybar:not([hidden])")
        assert KEY not in page.content()
        page.screenshot(path=artifacts / "api-key.png", full_page=True)
        page.fill("#apikey", KEY)
        page.click("#save-key")
        wait_ready(page)
        assert page.input_value("#model") == BUNDLED.name
        set_max_tokens(page, 8)
        send(page, "Once upon a time")
        page.wait_for_selector("#messages[data-done='1']", state="attached")
        assert "tok/s" in answers(page).last.locator(".stats").inner_text()
        # kept in the browser: a new page load does not ask again
        page.reload()
        wait_ready(page)
        assert page.is_hidden("#keybar")
        assert json.loads(page.evaluate("localStorage.getItem('mlxr.apiKey')")) == KEY
        assert all("401" in e for e in console.errors), console.errors
        ctx.close()
    finally:
        s.stop()
