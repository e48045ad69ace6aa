"""The `serve` fixture shared by the server tests: started ServerThreads over a fake engine,
stopped at the end of the test."""

from __future__ import annotations

import pytest

from jaxbatch.server.state import ServerLimits
from tests.server.support import FakeEngine, ServerThread


@pytest.fixture
def serve():
    """serve(engine=None, **ServerLimits fields) -> a started ServerThread (a FakeEngine whose
    steps take 5 ms unless an engine is given)."""
    started: list[ServerThread] = []

    def start(engine=None, **limits) -> ServerThread:
        s = ServerThread(engine or FakeEngine(step_sleep=0.005), served_names=["fake"],
                         limits=ServerLimits(**limits))
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()
