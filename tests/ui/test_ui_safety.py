"""The session browser's guards over plain HTTP: token, cross-site refusals, binding, and resuming a live stream."""

from __future__ import annotations

import http.client
import json
import re

import pytest

from loomray import control
from loomray.errors import LoomrayUserError
from loomray.storage import open_store
from loomray.ui.server import build_app


def request(server, method, path, headers=None, body=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=20)
    conn.request(method, path, body=body, headers=headers or {})
    res = conn.getresponse()
    data = res.read().decode()
    conn.close()
    return res, data


def csrf_of(server, path, headers=None):
    res, page = request(server, "GET", path, headers)
    assert res.status == 200
    return re.search(r'name="csrf" value="([^"]+)"', page).group(1)


def test_a_request_without_the_token_is_refused(servers):
    server = servers["token"]
    assert request(server, "GET", "/")[0].status == 401
    assert request(server, "GET", "/", {"Authorization": "Bearer wrong"})[0].status == 401
    assert request(server, "GET", "/static/app.js")[0].status == 401
    assert request(server, "GET", "/", {"Authorization": "Bearer s3cret-token"})[0].status == 200
    res, _ = request(server, "GET", "/?token=s3cret-token&status=completed")
    assert res.status == 303 and res.getheader("location") == "/?status=completed"  # the token leaves the URL
    cookie = res.getheader("set-cookie")
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie
    assert request(server, "GET", "/", {"Cookie": cookie.split(";")[0]})[0].status == 200


def test_a_non_loopback_binding_needs_a_token(seeded, monkeypatch):
    monkeypatch.delenv("LOOMRAY_UI_TOKEN", raising=False)
    with pytest.raises(LoomrayUserError, match="not a loopback address"):
        build_app(seeded.url, host="0.0.0.0")
    build_app(seeded.url, host="0.0.0.0", token="t")  # with one it serves
    monkeypatch.setenv("LOOMRAY_UI_TOKEN", "from-env")
    build_app(seeded.url, host="0.0.0.0")


def test_a_cross_site_post_is_refused_and_records_nothing(servers, seeded):
    server = servers["open"]
    path = f"/session/{seeded.fork_root}/signal?user=alice"
    csrf = csrf_of(server, f"/session/{seeded.fork_root}?user=alice")
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    evil = request(server, "POST", path, {**form, "Origin": "http://evil.example"}, f"csrf={csrf}&text=hi")
    assert evil[0].status == 403
    sneaky = request(server, "POST", path, {**form, "Sec-Fetch-Site": "cross-site"}, f"csrf={csrf}&text=hi")
    assert sneaky[0].status == 403
    own = f"http://127.0.0.1:{server.port}"
    tokenless = request(server, "POST", path, {**form, "Origin": own}, "csrf=guess&text=hi")
    assert tokenless[0].status == 403
    rebound = request(server, "GET", "/", {"Host": "attacker.example"})
    assert rebound[0].status == 421  # a loopback server answers to loopback names only (DNS rebinding)
    assert not [r for r in control.list_requests(open_store(seeded.url), seeded.fork_root, "alice")
                if r["kind"] == "signal"]
    res, _ = request(server, "POST", path, {**form, "Origin": own}, f"csrf={csrf}&text=hi")
    assert res.status == 303 and "done=" in res.getheader("location")


def test_a_stream_resumes_after_the_last_event_seen(servers, seeded):
    server = servers["open"]  # its streams end after 2 s
    path = f"/session/{seeded.fork_root}/events?user=alice"
    _, whole = request(server, "GET", path)
    ids = re.findall(r"^id: (.+)$", whole, re.M)
    assert len(ids) >= 4 and len(set(ids)) == len(ids)
    _, rest = request(server, "GET", path, {"Last-Event-ID": ids[1]})
    assert re.findall(r"^id: (.+)$", rest, re.M) == ids[2:]
    status = [json.loads(line[6:]) for line in rest.splitlines() if line.startswith("data: ") and '"status"' in line]
    assert status[0]["status"] == "completed"
