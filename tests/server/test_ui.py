"""The inspector page (/ui) in a real browser: Playwright driving Debian's chromium (`make`
installs it; Playwright's own browser download cannot work here), against the real server.

Screenshots of each view go to $KVMEM_UI_SHOTS when set (docs/ui/ holds the committed ones,
made by `KVMEM_UI_SHOTS=docs/ui pytest tests/server/test_ui.py`), else to the test's tmp folder.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import httpx
import pytest

from tests.server.serverproc import KEYS

SCRIPT_FACT = "<script>alert('owned')</script> My cat likes <b>tuna</b>."
FACTS = ["My dog is called Biscuit and loves carrots.", "I live in Galway and work as a ferry mechanic.",
         "My sister plays the cello in Cork.", SCRIPT_FACT]


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "Debian's chromium is not installed: `make install` (apt-get install chromium) puts it there"
    return path


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=_chromium(), args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("KVMEM_UI_SHOTS") or tmp_path_factory.mktemp("ui-shots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def ui_user(servers) -> dict:
    user = f"ui-{uuid.uuid4().hex[:6]}"
    with servers.get().client("alpha") as c:
        r = c.post("/v1/memories", json={"user_id": user, "facts": FACTS, "encode": "sync",
                                         "metadata": {"source": "ui-test"}})
        assert r.status_code == 200, r.text
    return {"user": user, "ids": [m["id"] for m in r.json()["results"]]}


@pytest.fixture
def page(browser, server):
    """A logged-in page; every request it makes is recorded (none may leave the server's origin)."""
    context = browser.new_context(base_url=server.url, viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    pg.requests = []
    pg.on("request", lambda req: pg.requests.append(req.url))
    pg.on("dialog", lambda d: pytest.fail(f"a script ran: dialog {d.message!r}"))
    first = pg.goto("/ui")
    assert first.status == 401 and pg.locator("input[name=key]").count() == 1
    pg.fill("input[name=key]", KEYS["alpha"])
    with pg.expect_navigation():
        pg.click("button:text-is('Open')")
    assert pg.url == server.url + "/ui", (pg.url, pg.content()[:800])
    yield pg
    assert pg.requests and all(url.startswith(server.url) for url in pg.requests), pg.requests
    context.close()


def _open_scope(page, user: str) -> None:
    page.click(f"#scopes a:text-is('{user}')")
    page.wait_for_selector("#facts")


def test_without_a_key_the_page_is_401(server):
    assert httpx.get(server.url + "/ui").status_code == 401
    assert httpx.get(server.url + "/ui/scope?user=x", cookies={"kvmem_ui_key": "wrong"}).status_code == 401
    ok = httpx.get(server.url + "/ui", headers={"Authorization": f"Bearer {KEYS['alpha']}"})
    assert ok.status_code == 200 and "default-src 'none'" in ok.headers["content-security-policy"]


def test_scopes_list_the_users_facts_and_kv_bytes(page, ui_user, shots):
    row = page.locator("#scopes tr", has_text=ui_user["user"])
    cells = row.locator("td").all_inner_texts()
    assert cells[3] == str(len(FACTS)) and int(cells[4].replace(",", "")) > 0, cells
    page.screenshot(path=str(shots / "scopes.png"), full_page=True)


def test_find_a_fact_by_search_and_open_its_history(page, ui_user, shots):
    _open_scope(page, ui_user["user"])
    assert page.locator("#facts tr").count() == len(FACTS) + 1
    assert page.locator("#facts td", has_text="encoded").count() == len(FACTS)
    page.fill("#search input[name=q]", "What is my dog called?")
    page.click("#search button")
    first = page.locator("#hits tr").nth(1)
    assert "Biscuit" in first.inner_text()
    dense, lexical = first.locator("td").nth(3).inner_text(), first.locator("td").nth(4).inner_text()
    assert float(dense) > 0 and float(lexical) > 0  # both rankings' scores beside the fused one
    page.screenshot(path=str(shots / "scope-search.png"), full_page=True)
    first.locator("a").click()
    page.wait_for_selector("#history")
    assert page.locator("#history td", has_text="ADD").count() == 1
    assert page.locator("#fact tr", has_text="KV tier").inner_text().endswith("disk")
    page.screenshot(path=str(shots / "fact.png"), full_page=True)


def test_a_fact_holding_a_script_is_shown_as_text(page, ui_user):
    _open_scope(page, ui_user["user"])
    cell = page.locator("#facts a", has_text="alert(")
    assert cell.inner_text() == SCRIPT_FACT  # the tags are text, not markup
    assert page.locator("#facts b").count() == 0


def test_a_chats_xray_shows_kv_and_text_facts(page, server, ui_user, shots):
    with server.client("alpha") as c:
        reply = c.post("/v1/chat/completions", json={
            "model": "kvmem", "max_tokens": 4, "messages": [{"role": "user", "content": "Where do I live?"}],
            "memory": {"user_id": ui_user["user"], "k": 3, "text_facts": 1}}).json()
    _open_scope(page, ui_user["user"])
    page.click(f"#chats a[href='/ui/chats/{reply['id']}']")
    rows = page.locator("table.trace tr")
    served = [rows.nth(i).locator("td").nth(3).inner_text() for i in range(1, rows.count())]
    assert served == ["kv", "kv", "text"]
    assert "text_facts" in rows.nth(3).inner_text()
    page.screenshot(path=str(shots / "chat-xray.png"), full_page=True)


def test_the_playground_answers_in_both_modes(page, ui_user, shots):
    _open_scope(page, ui_user["user"])
    page.fill("#ask input[name=question]", "What is my dog called?")
    page.click("#ask button")
    for mode in ("kv", "text"):
        box = page.locator(f"#answer-{mode}")
        assert box.locator(".answer").inner_text().strip() and "TTFT" in box.inner_text()
    assert page.locator("#answer-kv td.kv").count() > 0 and page.locator("#answer-text td.kv").count() == 0
    page.screenshot(path=str(shots / "playground.png"), full_page=True)


def test_forget_a_fact_and_it_is_gone_from_page_and_search(page, server, ui_user):
    fact_id = ui_user["ids"][2]  # the cello
    page.goto(f"/ui/facts/{fact_id}")
    page.click("text=Forget this fact…")
    page.wait_for_selector("#confirm")
    page.click("#confirm button")
    page.wait_for_selector("#facts")
    assert "cello" not in page.locator("#facts").inner_text()
    with server.client("alpha") as c:
        hits = c.post("/v1/memories/search", json={"user_id": ui_user["user"], "query": "cello"}).json()["results"]
    assert fact_id not in [h["id"] for h in hits]


def test_forms_refuse_cross_site_requests(server, ui_user):
    cookies = {"kvmem_ui_key": KEYS["alpha"]}
    url = f"{server.url}/ui/facts/{ui_user['ids'][0]}/forget"
    assert httpx.post(url, cookies=cookies, data={}).status_code == 403  # no token
    page = httpx.get(f"{server.url}/ui/facts/{ui_user['ids'][0]}/forget", cookies=cookies).text
    token = page.split('name="csrf" value="')[1].split('"')[0]
    evil = httpx.post(url, cookies=cookies, data={"csrf": token}, headers={"Origin": "https://evil.example"})
    assert evil.status_code == 403
    with httpx.Client(base_url=server.url) as c:
        assert c.get(f"/v1/memories/{ui_user['ids'][0]}", headers={"Authorization": f"Bearer {KEYS['alpha']}"}
                     ).status_code == 200  # still there


def test_another_tenant_sees_none_of_it(server, ui_user):
    beta = {"Authorization": f"Bearer {KEYS['beta']}"}
    assert ui_user["user"] not in httpx.get(server.url + "/ui", headers=beta).text
    assert httpx.get(f"{server.url}/ui/facts/{ui_user['ids'][0]}", headers=beta).status_code == 404


def test_forget_a_whole_scope_after_confirming(browser, server):
    user = f"ui-gone-{uuid.uuid4().hex[:6]}"
    with server.client("alpha") as c:
        assert c.post("/v1/memories", json={"user_id": user, "facts": ["I collect stamps.", "I own a kayak."]}
                      ).status_code == 200
    context = browser.new_context(base_url=server.url, extra_http_headers={"Authorization": f"Bearer {KEYS['alpha']}"})
    pg = context.new_page()
    pg.goto("/ui")
    _open_scope(pg, user)
    pg.click("text=Forget this scope…")
    assert "Forget every fact of user" in pg.locator("h2").inner_text()
    pg.click("#confirm button")
    pg.wait_for_selector("#scopes")
    assert pg.locator("#scopes a", has_text=user).count() == 0
    with server.client("alpha") as c:
        assert c.get("/v1/memories", params={"user_id": user}).json()["total"] == 0
    context.close()


def test_each_scope_row_counts_what_its_link_opens():
    """A row without an agent or run opens (and forgets) all of them: its count says so."""
    from kvmem.keeper import ScopeSummary
    from kvmem.server.ui import _rows

    groups = [ScopeSummary("t::al", None, None, 3, 30), ScopeSummary("t::al", "bot", None, 2, 20),
              ScopeSummary("t::al", "bot", "r1", 4, 40), ScopeSummary("t::bo", None, "r1", 1, 10)]
    assert _rows(groups) == [(("t::al", None, None), (9, 90)), (("t::al", "bot", None), (6, 60)),
                             (("t::al", "bot", "r1"), (4, 40)), (("t::bo", None, None), (1, 10)),
                             (("t::bo", None, "r1"), (1, 10))]
