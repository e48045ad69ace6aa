"""A server of several models on an event loop of its own thread (tests are plain synchronous
code), and small HTTP helpers."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request

from jaxbatch.multimodel import MultiServer


class MultiServerThread:
    def __init__(self, *args, **kwargs) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        kwargs.setdefault("port", 0)  # a free port
        self.server: MultiServer = self.call(MultiServer.start(*args, **kwargs))
        self.url = self.server.url
        self.pool = self.server.pool

    def call(self, coro, timeout: float = 300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.call(self.server.shutdown(grace=1.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def post(url: str, body: dict, headers: dict | None = None, timeout: float = 300
         ) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), method="POST", headers={
        "Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(url: str, headers: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def statuses(url: str) -> dict[str, dict]:
    code, body = get(url + "/v1/models")
    assert code == 200
    return {m["id"]: m["status"] for m in json.loads(body)["data"]}
