"""Stopping a generation call from the driver (partial rollout), through the store of the transfer group.

A Ray actor runs one call at a time, so the driver cannot reach a rollout rank in the middle of its
``generate_sequences`` with another call. It sets a key in the TCP store that actor rank 0 hosts for the
weight transfer instead (any node reaches it); the generating rank asks the store, at most every
``every_s`` seconds between two decode steps, whether its call's key is set, and stops there.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from hybridflow.hybrid_engine.pool_transfer import TransferAddress

_PREFIX = "hybridflow/interrupt/"


def interrupt_key(call: int) -> str:
    """The key that stops generation call ``call`` (the rollouter's chunk number)."""
    return f"{_PREFIX}{call}"


class InterruptPoller:
    """``poller()`` is True once the key is set; asks the store at most every ``every_s`` seconds."""

    def __init__(self, store: dist.Store, key: str, every_s: float = 0.02):
        self.store, self.key, self.every_s = store, key, every_s
        self.asked = 0.0
        self.stopped = False

    def __call__(self) -> bool:
        now = time.monotonic()
        if not self.stopped and now - self.asked >= self.every_s:
            self.asked = now
            self.stopped = self.store.check([self.key])
        return self.stopped


class Interrupter:
    """The driver's client of the store: ``interrupt(call)`` stops that call where it is."""

    def __init__(self, address: TransferAddress, timeout_s: float):
        self.store = dist.TCPStore(address.host, address.port, None, False, timeout=timedelta(seconds=timeout_s))

    def interrupt(self, call: int) -> None:
        self.store.set(interrupt_key(call), "1")
