"""No credential reaches the server's log: a key, a webhook secret or a session id sent in a query string (or in a
path) is refused or ignored, and the access and error log lines read ``***`` in its place."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.support.server import ServerProcess, wait_for


def test_a_key_in_the_query_string_is_refused_and_never_logged(tmp_path: Path) -> None:
    root = tmp_path / "server"
    server = ServerProcess(
        data_dir=root / "var",
        database_url=f"sqlite:///{root / 'miserver.db'}",
        env={"MISERVER_NO_MODEL": "1"},
        log_level="info",
    )
    with server:
        http = server.http()
        made = http.post("/api/keys", json={"name": "root", "admin": True})  # open: no key yet
        assert made.status_code == 200, made.text
        key: str = made.json()["key"]
        auth = {"Authorization": f"Bearer {key}"}
        secret = "whsec_c2VjcmV0LXZhbHVlLWZvci10ZXN0"
        session = "Zm9vYmFyYmF6cXV4LXNlc3Npb24tdG9rZW4"
        for name in ("api_key", "key", "token", "access_token"):
            refused = httpx.get(f"{server.base_url}/v1/files", params={name: key, "limit": "2"})
            assert refused.status_code == 401, refused.text
            message = refused.json()["error"]["message"]
            assert "Authorization" in message and "query string" in message, message
            assert key not in refused.text
        anthropic = httpx.post(f"{server.base_url}/anthropic/v1/messages", params={"api_key": key}, json={})
        assert anthropic.status_code == 401 and "x-api-key" in anthropic.json()["error"]["message"]
        assert httpx.get(f"{server.base_url}/v1/files/{key}").status_code == 401  # a key in a path
        assert http.get("/v1/files", params={"secret": secret, "session": session}, headers=auth).status_code == 200
        assert http.get(f"/v1/files?password={session}", headers=auth).status_code == 200
        wait_for(lambda: "/v1/files?password=" in server.log(10**7))
        log = server.log(10**7)
    assert "/v1/files?api_key=***&limit=2" in log, log[-3000:]  # the access log is on, and redacted
    for credential in (key, key.removeprefix("sk-"), key[3:11], key[-12:], secret, secret[6:], session):
        assert credential not in log, f"{credential!r} in the log:\n{log[-3000:]}"
