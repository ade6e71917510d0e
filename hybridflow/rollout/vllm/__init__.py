"""vLLM as a generation backend (`actor_rollout_ref.rollout.name=vllm`).

- backend.py   its registration as a backend, and its checks before a run
- config.py    VllmEngineConfig: the engine's settings (`rollout.vllm.*`)
- install.py   whether vLLM can run here (installed, importable, the model's head size), and how to install it
- kv_cache.py  CacheMemory: freeing the KV cache between generations (sleep mode, or the storage on CPU)
- rollout.py   VllmRollout: the `Rollout` interface over vLLM's offline engine, in the worker's process

Importing this package does not import vLLM; building a `VllmRollout` does. docs/results.md
compares it with the native engine.
"""

from hybridflow.rollout.vllm.config import VllmEngineConfig

__all__ = ["VllmEngineConfig"]
