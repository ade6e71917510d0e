"""`VllmRollout`: vLLM's engine behind the `Rollout` interface, a drop-in for `NativeRollout`.

vLLM runs inside the calling process (its one-process executor, no engine-core process), so
the generator's weights sit beside the trainer's shards and a weight sync is a copy in memory:
`load_weights` hands vLLM's in-place reload one tensor at a time (vLLM buffers the few tensors of
one layer, writes them into the layer's existing storage, and drops them). In a worker group
every rank starts its own engine on the group's process group; each generates for its own
prompts (rollout.tensor_model_parallel_size = 1).

The engine starts from the model's config with placeholder weights ("dummy" loading) and gets
the model's own weights right away, so nothing is read from disk twice and any in-memory model
(the trainer's, after some steps) can seed it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import tempfile
from collections.abc import Iterable, Iterator

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from hybridflow.batch_keys import ATTENTION_MASK, INPUT_IDS
from hybridflow.models.split_sizes import expert_count
from hybridflow.protocol import DataProto
from hybridflow.rollout.base import Rollout, SamplingParams, assemble_batch, stop_and_pad_ids
from hybridflow.rollout.vllm.config import VllmEngineConfig
from hybridflow.rollout.vllm.install import INSTALL_HINT, install_problem, loader_env_kept
from hybridflow.rollout.vllm.kv_cache import CacheMemory
from hybridflow.rollout.vllm.requests import VllmRequestEngine
from hybridflow.rollout.vllm.sampling import vllm_sampling

# Set before vLLM starts: the engine core in this process. A value already in the environment wins. (Its log
# level is library_output's: errors only, everything with --debug.)
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
ROTARY_BUFFERS = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")  # HF buffers vLLM has no place for
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """Undo what importing and starting vLLM does to the process it shares with the trainer.

    The engine reseeds the global random generators (Python, NumPy, torch), and its CPU worker
    lowers torch to one thread unless OMP_NUM_THREADS is set, then replaces torch.set_num_threads
    with a no-op; the import and the start set the loader's variables (`loader_env_kept`). The
    trainer's threads, random streams, that function and those variables are restored here.
    """
    threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
    python_rng, numpy_rng = random.getstate(), np.random.get_state()
    omp_before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = omp_before or str(threads)
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices), loader_env_kept():
            yield
    finally:
        torch.set_num_threads = set_num_threads
        set_num_threads(threads)
        random.setstate(python_rng)
        np.random.set_state(numpy_rng)
        if omp_before is None:
            os.environ.pop("OMP_NUM_THREADS", None)


class VllmRollout(Rollout):
    """Generation with vLLM (continuous batching, paged KV cache, prefix caching) in this process.

    model: a causal LM from transformers whose config and weights seed the engine (not kept).
    dtype: the engine's compute dtype, default the model's. stop_token_ids: tokens that end a
    response, default the EOS ids `NativeRollout` uses; [] generates every response to full
    length (benchmarks). engine_config: `actor_rollout_ref.rollout.vllm.*`.
    """

    reload_needs_every_weight = True  # its reload finishes a layer when all of its tensors came

    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        *,
        engine_config: VllmEngineConfig,
        dtype: torch.dtype | None = None,
        stop_token_ids: list[int] | None = None,
    ):
        problem = install_problem()
        if problem:
            raise ImportError(f"rollout.name=vllm needs vLLM, but {problem}; install it with: {INSTALL_HINT}")
        self.eos_token_ids, self.pad_token_id = stop_and_pad_ids(model.generation_config.eos_token_id, tokenizer)
        self.stop_token_ids = list(self.eos_token_ids if stop_token_ids is None else stop_token_ids)
        dtype = dtype or next(model.parameters()).dtype
        # the engine reads the model's config once, as it starts; the directory goes then (a worker process
        # ends by a kill, which skips the cleanup of anything left for its exit)
        with tempfile.TemporaryDirectory(prefix="hybridflow-vllm-") as config_dir:
            model.config.save_pretrained(config_dir)
            self.llm = _start_engine(config_dir, dtype, engine_config, mixture=expert_count(model.config) > 0)
        self.cache = CacheMemory(self.llm)
        self._requests: VllmRequestEngine | None = None
        self.load_weights((name, param.detach()) for name, param in model.named_parameters())

    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        """Same contract and layout as `NativeRollout.generate_sequences` (see `Rollout`).

        Each row is one request with its own seed (`request_seed`), so a row's samples depend on
        the call's seed and its index only. Log-probs are those of the distribution the token was
        drawn from: the temperature-scaled softmax, renormalised over the top-k / top-p candidates
        when those are on (the native engine reports the untruncated softmax; without top-k/top-p,
        the default in training, the two are the same).
        """
        from vllm.inputs import TokensPrompt

        prompt_ids, prompt_mask = prompts.batch[INPUT_IDS], prompts.batch[ATTENTION_MASK]
        requests = [
            TokensPrompt(prompt_token_ids=row[mask.bool()].tolist()) for row, mask in zip(prompt_ids, prompt_mask)
        ]
        sampling = [vllm_sampling(params, i, params.max_new_tokens, self.stop_token_ids) for i in range(len(requests))]
        self.cache.restore()
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        batch, width = len(requests), params.max_new_tokens
        responses = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        log_probs = torch.zeros(batch, width, dtype=torch.float32)
        mask = torch.zeros(batch, width, dtype=torch.long)
        for row, output in enumerate(outputs):
            completion = output.outputs[0]
            tokens = list(completion.token_ids)  # the stop token included, as the native engine keeps it
            responses[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            log_probs[row, : len(tokens)] = torch.tensor(
                [step[token].logprob for token, step in zip(tokens, completion.logprobs)]
            )
            mask[row, : len(tokens)] = 1
        device = prompt_ids.device
        batch_tensors = assemble_batch(
            prompt_ids,
            prompt_mask,
            responses.to(device),
            mask.to(device),
            log_probs.to(device),
            self.pad_token_id,
            self.stop_token_ids,
        )
        return DataProto.from_dict(batch_tensors, meta_info=dict(prompts.meta_info))

    def request_engine(self) -> VllmRequestEngine:
        """The same engine behind the request API of multi-turn rollout (requests.py)."""
        if self._requests is None:  # it refers to the engine, not back to this object: no cycle delays freeing
            self._requests = VllmRequestEngine(self.llm.llm_engine, self.cache, self.stop_token_ids)
        return self._requests

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Overwrite the engine's weights in place from (Hugging Face name, full tensor) pairs, one at a time.

        Every weight of the model must come (vLLM reloads layer by layer and finishes a layer when all
        its tensors arrived); rotary buffers are skipped (vLLM computes its own). Cached prompt prefixes
        are dropped: their keys and values belong to the old weights.
        """
        self.cache.restore()
        weights = ((name, tensor) for name, tensor in named_tensors if not name.endswith(ROTARY_BUFFERS))
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self.llm.collective_rpc(_repack_tied_lm_head)
        self.llm.reset_prefix_cache()

    def release_cache(self) -> None:
        """Free the KV cache until the next generation (see kv_cache.CacheMemory)."""
        self.cache.release()


def _repack_tied_lm_head(worker) -> None:
    """Run inside vLLM's worker after a reload. With tied embeddings the LM head shares the embedding's
    weight, and vLLM's reload processes a shared weight for the embedding only; on CPU the LM head keeps a
    packed copy of that weight for its matmul (``cpu_linear``), which would keep the old values. Pack it again."""
    model = worker.model_runner.model
    head = getattr(model, "lm_head", None)
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    if hasattr(head, "cpu_linear") and embedding is not None and head.weight is embedding.weight:
        head.quant_method.process_weights_after_loading(head)


# Warnings vLLM logs on every start or weight sync that say nothing wrong in the way hybridflow runs it
# (logger name: message prefixes). Every other warning passes.
BENIGN_WARNINGS = {
    # reload: rotary tables are computed, never loaded; a tied LM head shares the embedding's tensor
    # (and is packed again after each sync, _repack_tied_lm_head)
    "vllm.model_executor.model_loader.reload.layerwise": (
        "RotaryEmbedding: Failed to load weights",
        "ParallelLMHead: Failed to load weights",
    ),
    # skip_tokenizer_init: token ids in and out, stop tokens passed with every request
    "vllm.renderers.base": ("Chat template warmup failed", "Using None for EOS token id"),
}


def _quiet_benign_warnings() -> None:
    for name, prefixes in BENIGN_WARNINGS.items():
        logger = logging.getLogger(name)
        if not any(getattr(f, "benign_prefixes", None) == prefixes for f in logger.filters):
            logger.addFilter(_PrefixFilter(prefixes))


class _PrefixFilter(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.benign_prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.benign_prefixes)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _expert_group_made() -> None:
    """vLLM keeps the model-parallel groups its first engine in a process made, and makes an expert-parallel group
    only for a mixture of experts: an engine for a mixture after one for a dense model found none (an AssertionError
    at its first forward, "expert parallel group is not initialized"). Then the groups are made again, with it."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return
    try:
        parallel_state.get_ep_group()
    except AssertionError:
        parallel_state.destroy_model_parallel()


def _start_engine(config_dir: str, dtype: torch.dtype, config: VllmEngineConfig, mixture: bool = False):
    """vLLM's offline engine for the model described in ``config_dir``, in this process, with placeholder weights
    (``mixture``: the model has experts)."""
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    with _process_state_kept():
        from vllm import LLM

        _quiet_benign_warnings()
        if mixture:
            _expert_group_made()
        return LLM(
            model=config_dir,
            load_format="dummy",  # placeholder weights; the caller loads the real ones
            skip_tokenizer_init=True,  # token ids in, token ids out
            generation_config="vllm",  # ignore the model's generation_config.json defaults
            dtype=_DTYPE_NAMES[dtype],
            distributed_executor_backend="uni",  # this process; on the worker group's existing process group
            logprobs_mode="processed_logprobs",
            kv_cache_memory_bytes=int(config.kv_cache_gb * 2**30),
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len or None,
            enforce_eager=config.enforce_eager,
            enable_prefix_caching=config.enable_prefix_caching,
            # vLLM 0.32 on CPU crashes ("CPU Generator does not use offset") when a request with its own seed
            # has its prompt split over two steps: a prompt waits for the next step instead
            enable_chunked_prefill=not _on_cpu(),
            block_size=config.block_size or None,
            enable_sleep_mode=CacheMemory.sleep_mode_available(),
            seed=0,  # sampling draws from each request's own seed
        )
