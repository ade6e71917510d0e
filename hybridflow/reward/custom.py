"""Load a user's reward function from a Python file (`custom_reward_function.path` / `.name`).

The function is called for every sample instead of the registered scorers:

    def my_reward(data_source: str, solution_str: str, ground_truth, extra_info: dict | None) -> float | dict

and may return a dict with a "score" key plus extras, like the built-in scorers.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path


def load_custom_reward_fn(path: str, name: str) -> Callable[..., float | dict]:
    """The function `name` defined in the Python file at `path`.

    The file is imported as its own module (named after the file, so pickling by Ray and
    tracebacks show where it came from); errors name the config key to fix.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"custom reward file {str(file)!r} does not exist; fix custom_reward_function.path")
    module_name = f"hybridflow_custom_reward_{file.stem}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {str(file)!r} as Python; fix custom_reward_function.path")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        sys.modules.pop(module_name, None)
        raise ImportError(
            f"importing the custom reward file {str(file)!r} failed: {type(error).__name__}: {error}"
        ) from error
    if not hasattr(module, name):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(
            f"the custom reward file {str(file)!r} defines no {name!r}; it defines {defined}. "
            "Fix custom_reward_function.name"
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(
            f"{name!r} in {str(file)!r} is a {type(fn).__name__}, not a function; fix custom_reward_function.name"
        )
    return fn
