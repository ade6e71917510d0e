"""Load a user's reward function from a Python file (`custom_reward_function.path` / `.name`).

The function is called for every sample instead of the registered scorers:

    def my_reward(data_source: str, solution_str: str, ground_truth, extra_info: dict | None) -> float | dict

and may return a dict with a "score" key plus extras, like the built-in scorers.
"""

from __future__ import annotations

from collections.abc import Callable

from hybridflow.user_code import attribute, import_file


def load_custom_reward_fn(path: str, name: str) -> Callable[..., float | dict]:
    """The function `name` defined in the Python file at `path`; errors name the config key to fix."""
    module = import_file(path, "custom_reward_function.path")
    fn = attribute(module, name, f"the custom reward file {path!r}", "custom_reward_function.name")
    if not callable(fn):
        raise TypeError(
            f"{name!r} in {path!r} is a {type(fn).__name__}, not a function; fix custom_reward_function.name"
        )
    return fn
