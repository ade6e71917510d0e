"""The verifiers runner of one rollout (rollout.agent.verifiers): a process in the environment's own venv
(hybridflow/verifiers_runner/runner.py) that claims each generation call's sessions and runs their episodes
against the endpoint's token route.

It starts at the rollout's first call and stays up between calls, so the environment (and verifiers, whose import
alone takes seconds) loads once. If it exits while sessions of a call wait, they fail at once with the last lines
of its output, instead of after rollout.agent.timeout_s; the next call starts a fresh one.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from hybridflow.rollout.agent_server.config import VerifiersConfig
from hybridflow.rollout.agent_server.sessions import Session
from hybridflow.verifiers_runner.launch import serve_call, start_runner, verifiers_python

WATCH_INTERVAL_S = 0.1


class RunnerExited(RuntimeError):
    pass


class EnvironmentRunner:
    def __init__(self, settings: VerifiersConfig, tokenizer: Any, *, model: str, run_key: str):
        self.settings = settings
        self.python = verifiers_python(settings.python)  # found (or refused) when the rollout is built
        self.tokenizer = tokenizer
        self.model = model
        self.run_key = run_key
        self.process = None
        self.log = tempfile.TemporaryFile("w+")  # the runner's output, for the reason when it fails
        self.tokenizer_files: tempfile.TemporaryDirectory | None = None

    def _start(self) -> None:
        if self.tokenizer_files is None:  # the run's tokenizer, for verifiers' client to load from a directory
            self.tokenizer_files = tempfile.TemporaryDirectory(prefix="hybridflow-tokenizer-")
            self.tokenizer.save_pretrained(self.tokenizer_files.name)
        settings = self.settings
        self.process = start_runner(
            self.python,
            settings.env,
            settings.args,
            settings.path,
            run_key=self.run_key,
            tokenizer_dir=self.tokenizer_files.name,
            model=self.model,
            renderer=settings.renderer,
            log=self.log,
        )

    @asynccontextmanager
    async def serving(
        self, base_url: str, sessions: list[Session], *, temperature: float, top_p: float
    ) -> AsyncIterator[None]:
        """While the block runs, the runner serves the sessions of the endpoint at ``base_url``."""
        if self.process is None or self.process.poll() is not None:
            self._start()
        serve_call(self.process, base_url, temperature, top_p)  # if it has exited, the watcher says why
        watcher = asyncio.create_task(self._watch(sessions))
        try:
            yield
        finally:
            watcher.cancel()

    async def _watch(self, sessions: list[Session]) -> None:
        process = self.process
        while process.poll() is None:
            await asyncio.sleep(WATCH_INTERVAL_S)
        pending = [s for s in sessions if s.result is not None and not s.result.done()]
        if pending:
            error = RunnerExited(
                f"the verifiers runner exited ({process.returncode}) before this episode ended: {self._last_lines()}"
            )
            for session in pending:
                session.result.set_result(error)

    def _last_lines(self, count: int = 5) -> str:
        self.log.flush()
        self.log.seek(0)
        return " | ".join(line.strip() for line in self.log.read().strip().splitlines()[-count:])
