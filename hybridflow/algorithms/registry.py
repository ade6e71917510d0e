"""A name → object registry, shared by the advantage-estimator and policy-loss registries.

Registration is explicit (a decorator at the definition site); a duplicate name is an error
and so is an unknown one, whose message lists every known name so a typo in a config is
easy to fix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Names to entries for one kind of thing (e.g. "advantage estimator")."""

    def __init__(self, kind: str, config_key: str) -> None:
        self.kind = kind  # what is registered, used in error messages
        self.config_key = config_key  # the config key that selects an entry
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> None:
        """Register `entry` under `name`; raise ValueError if the name is taken."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = entry

    def decorator(self, name: str, entry_of: Callable[[Any], T] | None = None) -> Callable[[Any], T]:
        """A decorator that registers ``entry_of(fn)`` (``fn`` itself without ``entry_of``) under ``name`` and binds
        the decorated name to that entry."""

        def register(fn: Any) -> T:
            entry = fn if entry_of is None else entry_of(fn)
            self.add(name, entry)
            return entry

        return register

    def get(self, name: str) -> T:
        """The entry registered as `name`; ValueError listing the known names otherwise."""
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(self.names())
            raise ValueError(f"unknown {self.kind} {name!r} ({self.config_key}); known: {known}") from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
