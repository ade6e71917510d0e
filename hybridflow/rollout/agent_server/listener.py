"""The agent endpoint's server: its listening socket, and uvicorn serving server.py's app on it as a task in the
current event loop (``AgentServer.running()``), stopped at once when the generation call ends (``PromptStopServer``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI

from hybridflow.rollout.agent_server.config import AgentServerConfig

logger = logging.getLogger(__name__)


class PromptStopServer(uvicorn.Server):
    """uvicorn's server, stopped as soon as ``stop()`` asks: the end of every generation call waits for it.

    uvicorn looks at ``should_exit`` every 0.1 s, then closes its connections and sleeps another 0.1 s before
    waiting, again in steps of 0.1 s, for them to go: 0.15-0.2 s at the end of each call (docs/log/rollout.md §38).
    Here ``stop()`` wakes the main loop (which still ticks every 0.1 s meanwhile, as uvicorn's does, for the date
    header), and the close waits in steps of 2 ms only while a connection or a request is still open, at most the
    config's ``timeout_graceful_shutdown``, after which the requests left are cancelled."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._wake: asyncio.Event | None = None

    def stop(self) -> None:
        self.should_exit = True
        if self._wake is not None:
            self._wake.set()

    async def main_loop(self) -> None:
        self._wake = asyncio.Event()
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 0.1)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()  # no new connections
        for sock in sockets or []:
            sock.close()
        state = self.server_state
        for connection in list(state.connections):
            connection.shutdown()  # an idle one closes now, a busy one after its answer
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.config.timeout_graceful_shutdown or 0.0)
        while (state.connections or state.tasks) and loop.time() < deadline:
            await asyncio.sleep(0.002)
        for task in list(state.tasks):
            task.cancel(msg="the agent endpoint stopped")
        for server in self.servers:
            await server.wait_closed()


class AgentServer:
    """The endpoint of one generation call: ``async with server.running():`` serves it in the current event loop on
    ``config.host``; ``base_url`` is where agents reach it. Leaving the block stops it and closes its port."""

    def __init__(self, config: AgentServerConfig, app: FastAPI):
        self.config = config
        self.app = app
        self.port: int | None = None

    @property
    def base_url(self) -> str:
        host = self.config.host if ":" not in self.config.host else f"[{self.config.host}]"
        return f"http://{host}:{self.port}"

    @asynccontextmanager
    async def running(self) -> AsyncIterator[AgentServer]:
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.config.host, self.config.port))
        except OSError as error:
            sock.close()
            raise OSError(
                f"the agent endpoint cannot listen on {self.config.host}:{self.config.port}: {error}; "
                "set rollout.agent.host / rollout.agent.port"
            ) from error
        sock.listen(1024)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        server = PromptStopServer(
            uvicorn.Config(
                self.app,
                log_level="warning",
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=2,
                h11_max_incomplete_event_size=64 * 1024,
            )
        )
        server.capture_signals = contextlib.nullcontext  # the run's own signal handlers stay in charge
        task = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            while not server.started:
                if task.done():
                    task.result()  # raises what stopped it
                    raise RuntimeError("the agent endpoint stopped while starting")
                await asyncio.sleep(0.005)
            yield self
        finally:
            server.stop()
            try:
                await asyncio.wait_for(task, timeout=10)
            except Exception as error:  # noqa: BLE001
                logger.warning("agent endpoint: stopping: %r", error)
            sock.close()
