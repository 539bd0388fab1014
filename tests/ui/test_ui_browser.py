"""The session browser in headless Chromium: list, filters, a session's page, live updates, and acting on it."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import ui_agents
from playwright.sync_api import expect
from ui_harness import bound, wait_for

from loomray.storage import open_store


def test_the_list_shows_sessions_and_filters_them(page, servers, seeded):
    page.goto(servers["open"].base + "/")
    rows = page.locator("#sessions tbody tr")
    expect(rows.filter(has_text=seeded.fork_root)).to_have_count(1)
    expect(rows.filter(has_text=seeded.bob)).to_have_count(1)
    story = rows.filter(has_text=seeded.fork_root)
    expect(story.locator("td").nth(1)).to_have_text("alice")
    expect(story.locator("td").nth(3)).to_have_text("2")  # turns
    page.fill("input[name=user]", "bob")
    page.click("#apply")
    expect(page.locator("#total")).to_have_text("1")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text(seeded.bob)
    page.goto(servers["open"].base + "/?status=awaiting_approval")
    expect(page.locator("#sessions tbody tr")).to_have_count(5)
    page.goto(servers["open"].base + "/?q=s-xs")
    expect(page.locator("#sessions tbody tr")).to_have_count(1)
    expect(page.locator("#sessions tbody tr").first).to_contain_text(seeded.xss)


def test_a_session_page_shows_transcript_checkpoints_spend_and_fork_tree(page, servers, seeded, tmp_path):
    page.goto(servers["open"].base + "/")
    page.click(f"#sessions a:text-is('{seeded.fork_root}')")
    expect(page.locator("h1")).to_have_text(seeded.fork_root)
    transcript = page.locator("#transcript")
    expect(transcript.locator(".role-user").first).to_contain_text("Tell me a story.")
    expect(transcript.locator(".role-assistant").nth(1)).to_contain_text("second answer")
    expect(transcript.locator(".checkpoint")).not_to_have_count(0)
    expect(page.locator("#spend-chart polyline")).to_have_count(1)
    expect(page.locator("#incarnations tbody tr")).not_to_have_count(0)
    tree = page.locator("#fork-tree")
    for fork in seeded.forks:
        expect(tree.locator(f"a:text-is('{fork}')")).to_have_count(1)
    shots = Path(os.environ.get("LOOMRAY_UI_SCREENSHOTS") or tmp_path)  # the README's pictures come from here
    page.screenshot(path=str(shots / "ui-session.png"), full_page=True)
    tree.screenshot(path=str(shots / "ui-fork-tree.png"))
    tree.locator(f"a:text-is('{seeded.forks[0]}')").click()  # the tree is a way around
    expect(page.locator("h1")).to_have_text(seeded.forks[0])
    expect(page.locator("#fork-tree a.current")).to_have_text(seeded.forks[0])


def test_a_running_sessions_new_turn_appears_live(page, servers, seeded):
    agent = bound(seeded.url, "gated_agent")
    ui_agents.GATE.clear()
    runner = threading.Thread(target=agent.run_sync, args=("Take the step.",),
                              kwargs={"session_id": "s-live", "user_id": "alice"}, daemon=True)
    runner.start()
    store = open_store(seeded.url)
    wait_for(lambda: store.journal.runs("s-live", user_id="alice"), "the run to start")
    page.goto(servers["open"].base + "/session/s-live?user=alice")
    events = page.locator("#events")
    expect(events).to_contain_text("calls step")
    expect(events).not_to_contain_text("finished after the step")
    page.wait_for_timeout(2500)  # past one stream's end: the browser reconnects with Last-Event-ID
    ui_agents.GATE.set()
    expect(events).to_contain_text("answer: finished after the step", timeout=20_000)
    expect(page.locator("#status")).to_have_text("completed")
    expect(page.locator("#transcript")).to_contain_text("finished after the step")  # swapped in, no reload
    ids = page.locator("#events li").evaluate_all("els => els.map(e => e.dataset.id)")
    assert len(ids) == len(set(ids)), f"an entry shown twice across reconnects: {ids}"
    runner.join(30)


def test_approve_a_pending_call_and_the_session_completes(page, servers, seeded):
    page.goto(f"{servers['open'].base}/session/{seeded.approve}?user=alice")
    pending = page.locator(".pending")
    expect(pending).to_contain_text("publish")
    pending.locator("button.approve").click()
    expect(page.locator("#message")).to_contain_text("approved")
    expect(page.locator(".pending .decided")).to_have_text("approved")
    page.click("#resume")
    expect(page.locator("#status")).to_have_text("completed", timeout=20_000)
    expect(page.locator("#transcript")).to_contain_text("model saw: published as 'Q3'")


def test_deny_with_a_reason_reaches_the_model(page, servers, seeded):
    page.goto(f"{servers['open'].base}/session/{seeded.deny}?user=alice")
    page.fill(".pending input.reason", "not before the audit")
    page.locator(".pending button.deny").click()
    expect(page.locator(".pending .decided")).to_contain_text("denied (not before the audit)")
    page.click("#resume")
    expect(page.locator("#status")).to_have_text("completed", timeout=20_000)
    expect(page.locator("#transcript .role-assistant").last).to_contain_text("not before the audit")


def test_approve_with_edited_arguments_runs_the_tool_with_them(page, servers, seeded):
    page.goto(f"{servers['open'].base}/session/{seeded.edit}?user=alice")
    page.fill(".pending input.arguments", '{"title": "Q4 (edited)"}')
    page.locator(".pending button.approve-edited").click()
    expect(page.locator(".pending .decided")).to_have_text("approved with edited arguments")
    page.click("#resume")
    expect(page.locator("#status")).to_have_text("completed", timeout=20_000)
    expect(page.locator("#transcript")).to_contain_text("model saw: published as 'Q4 (edited)'")


def test_respond_in_the_tools_place_never_runs_it(page, servers, seeded):
    page.goto(f"{servers['open'].base}/session/{seeded.respond}?user=alice")
    page.fill(".pending input.response", "already published by hand")
    page.locator(".pending button.respond").click()
    expect(page.locator(".pending .decided")).to_have_text("answered in the tool's place")
    page.click("#resume")
    expect(page.locator("#status")).to_have_text("completed", timeout=20_000)
    expect(page.locator("#transcript")).to_contain_text("model saw: already published by hand")
    expect(page.locator("#transcript")).not_to_contain_text("published as")


def test_cancel_asks_first_then_cancels(page, servers, seeded):
    page.goto(f"{servers['open'].base}/session/{seeded.cancel}?user=alice")
    page.click("#cancel")
    expect(page.locator("h1")).to_contain_text("Cancel session")
    page.click("#confirm-cancel")
    expect(page.locator("#message")).to_contain_text("cancelled")
    expect(page.locator("#status")).to_have_text("cancelled")
    page.click("#resume")  # a cancelled session stays cancelled
    expect(page.locator("#status")).to_have_text("cancelled")


def test_transcript_payloads_render_inert(page, servers, seeded):
    page.goto(f"{servers['open'].base}/session/{seeded.xss}?user=alice")
    transcript = page.locator("#transcript")
    expect(transcript.locator(".role-assistant")).to_contain_text("<script>window.__pwned = 1</script>")
    expect(transcript.locator(".role-user")).to_contain_text('onerror="window.__pwned = 2"')
    assert transcript.locator("script, img").count() == 0
    page.wait_for_timeout(300)
    assert page.evaluate("window.__pwned === undefined")


def test_scoped_to_alice_shows_nothing_of_bob(page, servers, seeded):
    base = servers["alice"].base
    page.goto(base + "/")
    expect(page.locator("#sessions tbody tr").filter(has_text=seeded.fork_root)).to_have_count(1)
    expect(page.locator("#sessions")).not_to_contain_text("bob")
    expect(page.locator("input[name=user]")).to_have_count(0)
    assert page.goto(base + f"/session/{seeded.bob}?user=bob").status == 404
    assert page.goto(base + f"/session/{seeded.bob}").status == 404
    assert page.goto(base + "/?user=bob").ok
    expect(page.locator("#sessions")).not_to_contain_text("bob")
