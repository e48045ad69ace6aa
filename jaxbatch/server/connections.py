"""A TCP site with a cap on open connections (aiohttp has none).

Beyond `max_connections` open connections a new one is not handed to aiohttp: it is answered at
once with a 503 (OpenAI's error shape, `Retry-After`, `Connection: close`), its write side is shut
and it is closed when the client closes or after `_LINGER_S`, whichever is first; it never costs
a request handler. Like uvicorn's --limit-concurrency, open connections include idle keep-alive
ones (which the header timeout closes). The count is checked as each connection is accepted, so
a burst accepted in one event-loop turn may pass the cap by that burst.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from aiohttp import web

from jaxbatch.server.middleware import RETRY_AFTER_S

_LINGER_S = 2.0


def _refusal() -> bytes:
    body = json.dumps({"error": {"message": "too many open connections; retry later",
                                 "type": "server_error", "param": None, "code": None}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: {RETRY_AFTER_S}\r\n"
            f"Connection: close\r\n\r\n")
    return head.encode() + body


class _Refuse(asyncio.Protocol):
    """Answers 503 and closes; what the client sends meanwhile is read and dropped (closing with
    unread data would reset the connection and could lose the answer)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(_refusal())
        if transport.can_write_eof():
            transport.write_eof()
        self.timer = asyncio.get_running_loop().call_later(_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        self.transport.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.timer.cancel()


class LimitedTCPSite(web.BaseSite):
    """web.TCPSite with at most `max_connections` connections handed to aiohttp."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, max_connections: int,
                 on_refuse: Callable[[], None] | None = None, backlog: int = 128) -> None:
        super().__init__(runner, backlog=backlog)
        self._host, self._port = host, port
        self.max_connections = max_connections
        self.on_refuse = on_refuse
        self.refused = 0

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    @property
    def port(self) -> int:
        return self._port

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None

        def factory() -> asyncio.BaseProtocol:
            if len(server.connections) >= self.max_connections:
                self.refused += 1
                if self.on_refuse is not None:
                    self.on_refuse()
                return _Refuse()
            return server()

        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(factory, self._host, self._port,
                                                backlog=self._backlog, reuse_address=True)
        self._port = self._server.sockets[0].getsockname()[1]
