"""Continuous batching over the native forward: admit, prefill once per prompt, decode, retire.

Each loop iteration (1) admits waiting requests into free cache slots while the prefill
budget allows, running one batched prefill over the distinct prompts admitted (the n samples
of a prompt share it: its cache is copied to their slots, and all n draw their first token
from its logits), then (2) runs one decode step for every running sequence. A sequence
retires on a stop token or at `max_new_tokens`; its slot is refilled by the next waiting
request right away, so nothing waits for the longest sequence of a static batch. Running
sequences always occupy slots 0..B-1 (finished ones leave holes that are closed by moving
the last sequences down), so decode reads the cache through views, never gathers it.

The prompts of a call usually begin alike (the chat template's system prompt): their
longest common prefix is computed once, into a spare slot, and copied into each new
sequence's slot, so prefills only run the rest of each prompt.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridflow.rollout.native import model, ragged_attention
from hybridflow.rollout.native.config import NativeEngineConfig
from hybridflow.rollout.native.cpu_share import ThreadGovernor
from hybridflow.rollout.native.engine_stats import EngineStats
from hybridflow.rollout.native.kv_cache import KVCache
from hybridflow.rollout.native.route_log import RouteLog
from hybridflow.rollout.native.sampler import sample
from hybridflow.rollout.native.weights import Weights
from hybridflow.rollout.sampling import SamplingParams


@dataclass
class _Group:
    """Waiting requests with the same prompt (and the same tokens already generated, for continuations)."""

    prompt: list[int]  # what is prefilled: the prompt, then the response so far
    requests: deque[int]
    first_step: int = 0  # response tokens already generated (a continued request's prefix)


@dataclass(frozen=True)
class Continuation:
    """Requests that generation continues: each one's response so far (tokens and their log-probs), and the
    random stream each request samples from (its index in the call that began it), so that continuing with
    unchanged weights gives what one uninterrupted call gives."""

    prefixes: list[list[int]]
    prefix_log_probs: list[list[float]]
    streams: list[int]


class Engine:
    """Generates for many prompts at once with at most `max_num_seqs` sequences running."""

    def __init__(self, weights: Weights, config: NativeEngineConfig):
        self.weights = weights
        self.max_num_seqs = config.max_num_seqs
        self.max_prefill_tokens = config.max_prefill_tokens
        self.min_shared_prefix = config.min_shared_prefix  # shorter common prefixes are not worth a separate forward
        self.follow_free_cores = config.follow_free_cores
        self.ragged_decode = config.ragged_decode
        self.keep_cache = config.keep_cache
        self.cache: KVCache | None = None
        self.rope: model.RotaryTables | None = None
        self.stats = EngineStats()
        # after a `generate` call: which requests finished (False: interrupted) and how many tokens each has
        self.finished: torch.Tensor | None = None
        self.lengths: torch.Tensor | None = None
        self.routes: RouteLog | None = None  # after a call with ``params.record_routes``: each token's experts
        self.paused: _Run | None = None  # a call stopped with keep_on_stop, for resume

    @property
    def device(self) -> torch.device:
        return self.weights.embed.device

    @property
    def ragged(self) -> bool:
        """Whether decode reads each sequence's real length of its cache slot (ragged_attention.py), not the slot's
        whole row: asked for (``ragged_decode``), on CPU, and the kernel built (on the first call)."""
        return self.ragged_decode and self.device.type == "cpu" and ragged_attention.available()

    def release_cache(self) -> None:
        """After a generation call: free the KV cache, or keep it for the next call of its shape (``keep_cache``; null:
        on CPU). Its stale keys and values are finite and change no result: decode over whole rows masks them as a new
        cache's zeros, the ragged kernel reads only what each sequence wrote (tests/rollout/native/test_kv_cache.py)."""
        keep = self.device.type == "cpu" if self.keep_cache is None else self.keep_cache
        if not keep:
            self.cache = None

    def prepare(self, num_slots: int, max_len: int) -> None:
        """A KV cache of ``num_slots`` slots of at least ``max_len`` positions (kept when it already is one),
        and rotary tables that cover it."""
        spec, dtype = self.weights.spec, self.weights.embed.dtype
        if spec.sliding_window is not None and max_len > spec.sliding_window:
            raise NotImplementedError(f"sequences of {max_len} tokens exceed the sliding window {spec.sliding_window}")
        max_len = -(-max_len // 16) * 16  # round up, so that similar calls reuse the cache
        if self.cache is None or not self.cache.matches(num_slots, max_len, dtype):
            self.cache = None  # free the old one before allocating
            self.cache = KVCache(spec, num_slots, max_len, dtype, self.device)
        if self.rope is None or self.rope.max_len < self.cache.max_len or self.rope.cos.dtype != dtype:
            self.rope = model.RotaryTables(spec, self.cache.max_len, dtype, self.device)

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        stop_token_ids: list[int],
        pad_token_id: int,
        *,
        continuation: Continuation | None = None,
        should_stop: Callable[[], bool] | None = None,
        keep_on_stop: bool = False,
        seeds: list[int] | None = None,
        streams: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Generate up to `params.max_new_tokens` tokens for each prompt (token ids, no padding).

        Request i is prompt i; identical prompts prefill once. Returns tokens (N, R) (stop token
        included, `pad_token_id` after it) and their log-probs (N, R) (0 after), R = max_new_tokens.

        ``continuation``: request i already generated ``prefixes[i]`` (partial rollout, after new weights):
        its prompt and prefix are prefilled and it generates the rest of its R tokens, which the returned
        rows hold whole (the prefix's tokens and log-probs first). ``should_stop``: asked after every decode
        step; when it says so the call returns what it has, and ``self.finished`` tells which requests were
        cut short (``self.lengths`` how many tokens each has); ``keep_on_stop`` keeps the call's state and KV
        cache for ``resume``. ``seeds`` and ``streams``: request i samples from stream ``streams[i]`` of seed
        ``seeds[i]`` instead of stream i of ``params.seed`` (requests of several calls run together, each as alone).
        ``params.record_routes`` (a mixture of experts): ``self.routes`` logs each token's experts.
        """
        self.paused, self.routes = None, None
        n, r = len(prompts), params.max_new_tokens
        self.stats = EngineStats()
        tokens_out = torch.full((n, r), pad_token_id, dtype=torch.long, device=self.device)
        log_probs_out = torch.zeros(n, r, dtype=torch.float32, device=self.device)
        self.finished = torch.ones(n, dtype=torch.bool)
        self.lengths = torch.zeros(n, dtype=torch.long)
        if n == 0 or r == 0:
            return tokens_out, log_probs_out
        if min(len(p) for p in prompts) == 0:
            raise ValueError("every prompt needs at least one token")
        prefixes = continuation.prefixes if continuation is not None else [[] for _ in prompts]
        if any(len(prefix) >= r for prefix in prefixes):
            raise ValueError(f"a continued request already has all {r} of its tokens")
        if streams is None:
            streams = continuation.streams if continuation is not None else list(range(n))
        for i, prefix in enumerate(prefixes):
            if prefix:
                tokens_out[i, : len(prefix)] = torch.tensor(prefix)
                log_probs_out[i, : len(prefix)] = torch.tensor(continuation.prefix_log_probs[i])
        capacity = min(n, self.max_num_seqs)
        longest = max(len(p) + len(x) for p, x in zip(prompts, prefixes)) + r
        self.prepare(capacity + 1, longest)  # +1: the prefix slot
        self.routes = self._route_log(n, longest) if params.record_routes else None
        run = _Run(self, capacity, params, stop_token_ids, tokens_out, log_probs_out, streams, seeds)
        by_prompt: dict[tuple[tuple[int, ...], int], _Group] = {}
        for i, (prompt, prefix) in enumerate(zip(prompts, prefixes)):
            key = (tuple(prompt) + tuple(prefix), len(prefix))
            by_prompt.setdefault(key, _Group(list(prompt) + list(prefix), deque(), len(prefix))).requests.append(i)
        run.waiting.extend(by_prompt.values())
        run.share_prefix([group.prompt for group in by_prompt.values()])
        run.prefix_lengths = [len(prefix) for prefix in prefixes]
        return self._drive(run, should_stop, keep_on_stop)

    def _route_log(self, requests: int, positions: int) -> RouteLog:
        spec = self.weights.spec
        if not spec.num_experts:
            raise ValueError("record_routes: the model has no mixture-of-experts layers")
        return RouteLog(requests, positions, self.weights.model_layers, spec.experts_per_token, self.device)

    @torch.no_grad()
    def resume(self, should_stop: Callable[[], bool] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Go on with the call that ``generate(..., keep_on_stop=True)`` stopped, under the weights held now,
        over the KV cache the old weights computed (partial rollout's "KV kept"; the alternative continues from
        the tokens, prefilled again). Returns the whole rows, as ``generate`` does."""
        if self.paused is None:
            raise RuntimeError("no stopped call to resume")
        run, self.paused = self.paused, None
        return self._drive(run, should_stop, keep_on_stop=True)

    def _drive(
        self, run: _Run, should_stop: Callable[[], bool] | None, keep_on_stop: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.finished = torch.ones(len(run.tokens_out), dtype=torch.bool)
        self.lengths = torch.zeros(len(run.tokens_out), dtype=torch.long)
        threads = ThreadGovernor(enabled=self.follow_free_cores)  # threads follow the free cores
        try:
            while run.waiting or run.running:
                threads.tick()
                run.compact()
                run.admit()
                run.compact()
                if run.running:
                    run.decode()
                if should_stop is not None and (run.waiting or run.running) and should_stop():
                    run.mark_unfinished()
                    if keep_on_stop:
                        self.paused = run
                    else:
                        run.waiting.clear()
                        run.running, run.finished = 0, set()
                    break
        finally:
            threads.restore()
        return run.tokens_out, run.log_probs_out


class _Run:
    """The state of one `generate` call: waiting groups, running slots, outputs."""

    def __init__(
        self,
        engine: Engine,
        capacity: int,
        params: SamplingParams,
        stop_ids: list[int],
        tokens_out: torch.Tensor,
        log_probs_out: torch.Tensor,
        streams: list[int],
        seeds: list[int] | None = None,
    ):
        self.engine, self.params = engine, params
        self.streams = torch.tensor(streams, dtype=torch.long, device=engine.device)  # each request's random stream
        # each request's seed (None: the call's)
        self.seeds = None if seeds is None else torch.tensor(seeds, dtype=torch.long, device=engine.device)
        self.cache: KVCache = engine.cache
        self.stats = engine.stats
        self.routes = engine.routes  # None: the call records no routes
        device = engine.device
        self.stop_ids = torch.tensor(stop_ids, dtype=torch.long, device=device)
        self.tokens_out, self.log_probs_out = tokens_out, log_probs_out
        self.prefix_lengths: list[int] = []  # per request, response tokens it had when the call began
        self.waiting: deque[_Group] = deque()
        self.running = 0  # sequences in slots 0..running-1, including finished ones not yet removed
        self.finished: set[int] = set()  # slots whose sequence is done
        self.capacity = capacity  # sequences running at most, in slots 0..capacity-1
        self.prefix_slot = self.cache.num_slots - 1  # holds the common prefix of all prompts
        self.prefix_len = 0
        slots = capacity
        self.last_token = torch.zeros(slots, dtype=torch.long, device=device)  # latest token of each slot
        self.position = torch.zeros(slots, dtype=torch.long, device=device)  # where that token goes in the cache
        self.request = torch.zeros(slots, dtype=torch.long, device=device)  # request index of each slot
        self.step = torch.zeros(slots, dtype=torch.long, device=device)  # tokens generated so far

    def share_prefix(self, distinct_prompts: list[list[int]]) -> None:
        """Compute the longest common prefix of the prompts once, into the prefix slot."""
        if len(distinct_prompts) < 2:
            return
        first, limit = distinct_prompts[0], min(len(p) for p in distinct_prompts) - 1  # keep >= 1 token to prefill
        length = 0
        while length < limit and all(p[length] == first[length] for p in distinct_prompts):
            length += 1
        if length < self.engine.min_shared_prefix:
            return
        engine, device = self.engine, self.engine.device
        tokens = torch.tensor([first[:length]], device=device)
        slot = torch.tensor([self.prefix_slot], device=device)
        record = None if self.routes is None else []
        lengths = torch.tensor([length], device=device)
        model.prefill(engine.weights, engine.rope, self.cache, tokens, lengths, slot, record=record)
        if self.routes is not None:
            self.routes.shared_prefix(record)
        self.prefix_len = length
        self.stats.prefill_calls += 1
        self.stats.prefill_tokens += length
        self.stats.shared_prefix_tokens = length

    def compact(self) -> None:
        """Remove finished sequences, moving the last running ones into their slots."""
        if not self.finished:
            return
        keep = self.running - len(self.finished)
        holes = sorted(s for s in self.finished if s < keep)
        movers = [s for s in range(keep, self.running) if s not in self.finished]
        if holes:
            self.cache.copy_slots(movers, holes, int(self.position[movers].max()) + 1)
            src = torch.tensor(movers, device=self.step.device)
            dst = torch.tensor(holes, device=self.step.device)
            for state in (self.last_token, self.position, self.request, self.step):
                state[dst] = state[src]
            self.stats.slot_moves += len(holes)
        self.running, self.finished = keep, set()

    def mark_unfinished(self) -> None:
        """At a stop: mark the requests still running or waiting as unfinished, with the tokens they have."""
        finished, lengths = self.engine.finished, self.engine.lengths
        for slot in range(self.running):
            if slot not in self.finished:
                request = int(self.request[slot])
                finished[request], lengths[request] = False, int(self.step[slot])
        for group in self.waiting:
            for request in group.requests:
                finished[request], lengths[request] = False, self.prefix_lengths[request]

    def _record(self, slots: slice, tokens: torch.Tensor, log_probs: torch.Tensor) -> None:
        """Store each slot's new token and retire those that stopped: slots cover B slots, tensors (B,)."""
        request, step = self.request[slots], self.step[slots]
        self.tokens_out[request, step] = tokens
        self.log_probs_out[request, step] = log_probs
        self.last_token[slots] = tokens
        step += 1  # in place: a view of self.step
        done = torch.isin(tokens, self.stop_ids) | (step >= self.params.max_new_tokens)
        first = slots.start
        self.finished.update(first + i for i in done.nonzero()[:, 0].tolist())

    def admit(self) -> None:
        """Move waiting requests into free slots and prefill their distinct prompts in one batch."""
        free, budget = self.capacity - self.running, self.engine.max_prefill_tokens
        admitted: list[tuple[list[int], list[int]]] = []  # (prompt, requests)
        first_steps: list[int] = []
        while self.waiting and free > 0:
            group = self.waiting[0]
            longest = max([len(group.prompt)] + [len(p) for p, _ in admitted]) - self.prefix_len
            if admitted and longest * (len(admitted) + 1) > budget:
                break
            take = [group.requests.popleft() for _ in range(min(free, len(group.requests)))]
            admitted.append((group.prompt, take))
            first_steps.append(group.first_step)
            free -= len(take)
            if not group.requests:
                self.waiting.popleft()
        if admitted:
            self._prefill(admitted, first_steps)

    def _prefill(self, admitted: list[tuple[list[int], list[int]]], first_steps: list[int]) -> None:
        engine, device, start = self.engine, self.engine.device, self.prefix_len
        lengths = [len(p) for p, _ in admitted]
        tokens = torch.zeros(len(admitted), max(lengths) - start, dtype=torch.long)
        for row, (prompt, _) in enumerate(admitted):
            tokens[row, : len(prompt) - start] = torch.tensor(prompt[start:])
        first = self.running
        leaders, copies_src, copies_dst, member_rows, requests = [], [], [], [], []
        slot = first
        for row, (_, group_requests) in enumerate(admitted):
            leaders.append(slot)
            copies_src += [slot] * (len(group_requests) - 1)
            copies_dst += list(range(slot + 1, slot + len(group_requests)))
            member_rows += [row] * len(group_requests)
            requests += group_requests
            slot += len(group_requests)
        lengths_t = torch.tensor(lengths, device=device)
        self.cache.copy_slots([self.prefix_slot] * len(leaders), leaders, start)
        record = None if self.routes is None else []
        logits = model.prefill(
            engine.weights,
            engine.rope,
            self.cache,
            tokens.to(device),
            lengths_t - start,
            torch.tensor(leaders, device=device),
            start,
            record,
        )
        if self.routes is not None:
            self.routes.prompts(record, tokens.shape[1], lengths, [members for _, members in admitted])
        self.cache.copy_slots(copies_src, copies_dst, max(lengths))
        new = slice(first, slot)
        self.running = slot
        self.request[new] = torch.tensor(requests, device=device)
        self.step[new] = torch.tensor([first_steps[row] for row in member_rows], device=device)
        self.position[new] = lengths_t[torch.tensor(member_rows, device=device)]
        tokens_new, log_probs = sample(
            logits[member_rows], self.params, self.streams[self.request[new]], self.step[new], self._seeds(new)
        )
        self._record(new, tokens_new, log_probs)
        self.stats.prefill_calls += 1
        self.stats.prefill_sequences += len(admitted)
        self.stats.prefill_tokens += sum(lengths) - start * len(lengths)

    def _seeds(self, rows: slice) -> torch.Tensor | None:
        return None if self.seeds is None else self.seeds[self.request[rows]]

    def decode(self) -> None:
        """One token for every running sequence."""
        engine, b = self.engine, self.running
        running = slice(0, b)
        record = None if self.routes is None else []
        logits = model.decode(
            engine.weights,
            engine.rope,
            self.cache,
            self.last_token[:b],
            self.position[:b],
            engine.ragged,
            record=record,
        )
        if self.routes is not None:
            self.routes.tokens(record, self.request[running], self.position[running])
        self.position[running] += 1
        tokens, log_probs = sample(
            logits, self.params, self.streams[self.request[running]], self.step[running], self._seeds(running)
        )
        self._record(running, tokens, log_probs)
        self.stats.decode_steps += 1
        self.stats.decode_tokens += b
        self.stats.max_running = max(self.stats.max_running, b)
