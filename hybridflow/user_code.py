"""Loading a user's Python object named in the config: a reward function, a tool, an agent loop.

An object is named as ``path/to/file.py:name`` (a file, imported as its own module, so that Ray can
pickle what it defines and tracebacks show where it came from) or ``package.module:name`` (an
installed module). Every error names the config key to fix.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


def import_file(path: str | Path, key: str) -> Any:
    """The Python file at ``path`` as a module (``key``: the config key that named it, for errors)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"{str(file)!r} does not exist; fix {key}")
    module_name = f"hybridflow_user_{file.stem}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {str(file)!r} as Python; fix {key}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        sys.modules.pop(module_name, None)
        raise ImportError(f"importing {str(file)!r} failed: {type(error).__name__}: {error}") from error
    return module


def attribute(module: Any, name: str, where: str, key: str) -> Any:
    """``module.name``, or an error listing what ``where`` (the file or module) does define."""
    if not hasattr(module, name):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(f"{where} defines no {name!r}; it defines {defined}. Fix {key}")
    return getattr(module, name)


def load_object(spec: str, key: str) -> Any:
    """The object named by ``file.py:name`` or ``package.module:name``."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ValueError(f"{spec!r} is not of the form path/to/file.py:name or package.module:name; fix {key}")
    if where.endswith(".py"):
        return attribute(import_file(where, key), name, repr(where), key)
    try:
        module = importlib.import_module(where)
    except ImportError as error:
        raise ImportError(f"cannot import module {where!r} ({error}); fix {key}") from error
    return attribute(module, name, f"module {where!r}", key)
