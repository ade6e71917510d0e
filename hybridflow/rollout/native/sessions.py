"""The native engine behind the asynchronous request API (rollout/requests.py): multi-turn continuous batching.

A request keeps its cache slot from its first turn to its release, so a later turn appends its new
tokens to what is cached and computes only those (`model.extend`). Between turns, while the agent
loop runs its tools, the request's slot is *parked*: it holds its keys/values but is not decoded.

Slots: with ragged decode (rollout.native.ragged_decode, the default on CPU) decode reads each request's
own slot and length wherever it is, so a request keeps its slot from its first turn to its release and
nothing is ever moved. Over whole rows (the fallback) decode reads slots 0..B-1 as contiguous views
(model.decode), so the B requests decoding now always sit there; parked and free slots lie above. A
request whose turn ends inside 0..B-1 is then moved above (its keys/values copied to a free slot) and
the last decoding request moves down into the hole; a request that resumes is copied to slot B. There is
always one free slot beyond the holders for these moves, and one scratch slot for the shared prompt
prefix and the pad positions of `extend`.

Each engine step (run between the event loop's other work, so tools progress while it decodes):
  1. admit waiting turns: resumed requests (their slot is kept) and new ones while slots are free,
     within the prefill token budget; identical new prompts (a prompt's n samples) are computed
     once and copied, and their common prefix (a chat template's system prompt) once for all;
  2. one `extend` forward over the admitted rows, which samples each one's first token of the turn;
  3. one decode step over every request in 0..B-1;
  a turn ends on a stop token or at its max_new_tokens, and its future resolves right away.

Serving with ``params.record_routes`` (a mixture of experts), each request logs the experts of every position its
forwards compute (the shared prefix, extends, decode steps), and each turn returns the log so far (routing replay).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from hybridflow.models.routing import ROUTE_DTYPE
from hybridflow.rollout.native import model
from hybridflow.rollout.native.cpu_share import ThreadGovernor
from hybridflow.rollout.native.engine import Engine
from hybridflow.rollout.native.route_log import by_token
from hybridflow.rollout.native.sampler import sample
from hybridflow.rollout.requests import SteppedRequestEngine, TurnOutput


@dataclass(eq=False)
class _Request:
    index: int  # the request's number: its sampling stream
    pending: list[int] = field(default_factory=list)  # tokens to append at the next admission (not cached)
    history: list[int] = field(default_factory=list)  # the whole context so far (re-prefill mode only)
    length: int = 0  # positions cached in its slot
    generated: int = 0  # tokens generated over all turns: the sampler's step counter
    slot: int | None = None
    budget: int = 0  # max new tokens of the current turn
    tokens: list[int] = field(default_factory=list)  # the current turn's output
    log_probs: list[float] = field(default_factory=list)
    future: asyncio.Future | None = None  # set while a turn is in progress
    routes: torch.Tensor | None = None  # recording routes: (max_len, layers, k) experts of each cached position

    @property
    def decoding(self) -> bool:
        return self.future is not None and not self.pending


class NativeRequestEngine(SteppedRequestEngine):
    """Serves multi-turn requests on the native engine's weights and KV cache.

    reuse_cache=False re-prefills each request's whole context at every turn instead of appending
    (the baseline of bench/agent_rollout.py); the samples are the same, only the work differs.
    """

    def __init__(self, engine: Engine, stop_token_ids: list[int], *, reuse_cache: bool = True):
        super().__init__()
        self.engine = engine
        self.stop_ids = set(stop_token_ids)
        self.reuse_cache = reuse_cache

    # ---- the request API ----------------------------------------------------------------------

    def _open(self, max_requests: int) -> None:
        self.capacity = max(1, min(max_requests, self.engine.max_num_seqs))
        self.engine.prepare(self.capacity + 2, self.max_len)  # +1 spare for moves, +1 scratch
        self.scratch = self.capacity + 1
        self.owner: list[_Request | None] = [None] * (self.capacity + 1)  # slot -> request holding it
        self.active: list[_Request] = []  # the requests in slots 0..B-1, in slot order
        self.waiting: list[_Request] = []  # turns whose tokens wait to be admitted
        self.requests: dict[int, _Request] = {}
        # while serving, torch's threads follow the cores other processes (the tools' included) leave free
        self.governor = ThreadGovernor(enabled=self.engine.follow_free_cores)
        # slots are sized for the longest conversation the budgets allow: decode reads only what each one holds
        self.ragged = self.engine.ragged
        self.recording = self.params.record_routes

    def route_shape(self) -> tuple[int, int] | None:
        weights = self.engine.weights
        return (weights.model_layers, weights.spec.experts_per_token) if weights.spec.num_experts else None

    async def generate(self, request: int, new_tokens: list[int], max_new_tokens: int) -> TurnOutput:
        self.require_serving()
        req = self.requests.setdefault(request, _Request(request))
        if self.recording and req.routes is None:
            shape = (self.max_len, *self.route_shape())
            req.routes = torch.full(shape, -1, dtype=ROUTE_DTYPE, device=self.engine.device)
        if req.future is not None:
            raise RuntimeError(f"request {request} is already generating a turn")
        pending = req.pending + list(new_tokens)  # after the uncached last token of its previous turn
        self.check_turn(request, req.length + len(pending), max_new_tokens)
        req.pending = pending
        if not self.reuse_cache:
            req.history += req.pending
            req.pending, req.length = list(req.history), 0
        req.budget, req.tokens, req.log_probs = max_new_tokens, [], []
        req.future = future = asyncio.get_running_loop().create_future()
        self.waiting.append(req)
        self.wake()
        try:
            return await future
        except asyncio.CancelledError:  # e.g. the agent loop timed out: stop decoding it, keep its slot
            if req in self.waiting:
                self.waiting.remove(req)
            if req.future is future:
                req.future, req.pending = None, []  # parked at the next compaction; release frees it
            raise

    def release(self, request: int) -> None:
        req = self.requests.pop(request, None)
        if req is None:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        if req.slot is not None and req not in self.active:
            self.owner[req.slot] = None
            req.slot = None
            self.wake()  # a request waiting for a slot may start now

    # ---- the server ---------------------------------------------------------------------------

    def _has_work(self) -> bool:
        return bool(self.active) or self._admissible()

    def _unanswered(self) -> list[asyncio.Future]:
        return [req.future for req in self.active + self.waiting if req.future is not None]

    def _admissible(self) -> bool:
        holders = sum(owner is not None for owner in self.owner)
        return any(req.slot is not None or holders < self.capacity for req in self.waiting)

    def _close(self) -> None:
        self.governor.restore()

    @torch.no_grad()
    def _step(self) -> None:
        self.governor.tick()
        admitted = self._admit()
        if admitted:
            self._prefill(admitted)
            self._compact()
        if self.active:
            self._decode()
            self._compact()

    def _admit(self) -> list[_Request]:
        """Move waiting turns into slots B, B+1, ...: resumed ones always, new ones while slots are free."""
        holders = sum(owner is not None for owner in self.owner)
        budget, admitted, widest = self.engine.max_prefill_tokens, [], 0
        for req in list(self.waiting):
            if req.slot is None and holders >= self.capacity:
                continue
            widest = max(widest, len(req.pending))
            if admitted and widest * (len(admitted) + 1) > budget:
                break
            holders += req.slot is None
            self.waiting.remove(req)
            self._place(req, len(self.active))
            self.active.append(req)
            admitted.append(req)
        return admitted

    def _place(self, req: _Request, target: int) -> None:
        """Put ``req`` in slot ``target`` (just above the decoding ones), moving a parked request out of the way.
        Ragged decode reads any slots: a resumed request stays where it is, a new one takes any free slot."""
        if self.ragged:
            if req.slot is None:
                req.slot = self._free_slot()
                self.owner[req.slot] = req
            return
        parked = self.owner[target]
        if parked is req:
            return
        if parked is not None:
            self._move(parked, self._free_slot())
        if req.slot is not None:
            self._move(req, target)
        else:
            req.slot, self.owner[target] = target, req

    def _free_slot(self) -> int:
        lowest = 0 if self.ragged else len(self.active)  # whole-row decode keeps 0..B-1 for the decoding ones
        for slot in range(len(self.owner) - 1, lowest - 1, -1):
            if self.owner[slot] is None:
                return slot
        raise RuntimeError("no free KV-cache slot (the engine's slot accounting is broken)")

    def _move(self, req: _Request, target: int) -> None:
        self.engine.cache.copy_slots([req.slot], [target], req.length)
        self.owner[req.slot], self.owner[target], req.slot = None, req, target
        self._stats.slot_moves += 1

    def _prefill(self, admitted: list[_Request]) -> None:
        """Compute the admitted requests' pending tokens and sample each one's first token of the turn."""
        leaders: dict[tuple[int, ...], _Request] = {}
        followers: list[tuple[_Request, _Request]] = []
        for req in admitted:
            key = tuple(req.pending)
            if req.length == 0 and key in leaders:
                followers.append((req, leaders[key]))
            else:
                leaders[key if req.length == 0 else (-1 - req.index,)] = req
        rows = list(leaders.values())
        shared = self._share_prefix([req for req in rows if req.length == 0])
        starts = [req.length or shared for req in rows]
        lengths = [len(req.pending) - (start - req.length) for req, start in zip(rows, starts)]
        tokens = torch.zeros(len(rows), max(lengths), dtype=torch.long)
        for row, (req, start, n) in enumerate(zip(rows, starts, lengths)):
            tokens[row, :n] = torch.tensor(req.pending[start - req.length :])
        engine, device = self.engine, self.engine.device
        record = [] if self.recording else None
        logits = model.extend(
            engine.weights,
            engine.rope,
            engine.cache,
            tokens.to(device),
            torch.tensor(lengths, device=device),
            torch.tensor(starts, device=device),
            torch.tensor([req.slot for req in rows], device=device),
            self.scratch,
            self.ragged,
            record,
        )
        if record is not None:  # the real tokens, row by row
            for req, start, chosen in zip(rows, starts, by_token(record).split(lengths)):
                req.routes[start : start + len(chosen)] = chosen
        self._stats.prefill_calls += 1
        self._stats.prefill_tokens += sum(lengths)
        for req in rows:
            req.length += len(req.pending)
            req.pending = []
        for req, leader in followers:
            engine.cache.copy_slots([leader.slot], [req.slot], leader.length)
            req.length, req.pending = leader.length, []
            if self.recording:
                req.routes[: req.length] = leader.routes[: req.length]
        row_of = {id(req): row for row, req in enumerate(rows)}
        ordered = rows + [req for req, _ in followers]
        picks = [row_of[id(req)] for req in rows] + [row_of[id(leader)] for _, leader in followers]
        self._sample(ordered, logits[picks])

    def _share_prefix(self, new: list[_Request]) -> int:
        """Compute the longest common prefix of the new prompts once into the scratch slot and copy it into
        theirs; returns its length (0 when there is none worth it)."""
        if len(new) < 2:
            return 0
        first, limit = new[0].pending, min(len(req.pending) for req in new) - 1  # keep >= 1 token each
        length = 0
        while length < limit and all(req.pending[length] == first[length] for req in new):
            length += 1
        if length < self.engine.min_shared_prefix:
            return 0
        engine, device = self.engine, self.engine.device
        record = [] if self.recording else None
        model.prefill(
            engine.weights,
            engine.rope,
            engine.cache,
            torch.tensor([first[:length]], device=device),
            torch.tensor([length], device=device),
            torch.tensor([self.scratch], device=device),
            record=record,
        )
        if record is not None:
            prefix = by_token(record)
            for req in new:
                req.routes[:length] = prefix
        engine.cache.copy_slots([self.scratch] * len(new), [req.slot for req in new], length)
        self._stats.prefill_calls += 1
        self._stats.prefill_tokens += length
        self._stats.shared_prefix_tokens += length
        return length

    def _decode(self) -> None:
        device = self.engine.device
        last = torch.tensor([req.tokens[-1] for req in self.active], device=device)
        positions = torch.tensor([req.length for req in self.active], device=device)
        engine = self.engine
        slots = torch.tensor([req.slot for req in self.active], device=device) if self.ragged else None
        record = [] if self.recording else None
        logits = model.decode(engine.weights, engine.rope, engine.cache, last, positions, self.ragged, slots, record)
        if record is not None:
            for req, chosen in zip(self.active, by_token(record)):
                req.routes[req.length] = chosen
        for req in self.active:
            req.length += 1
        self._stats.decode_steps += 1
        self._stats.decode_tokens += len(self.active)
        self._sample(self.active, logits)

    def _sample(self, reqs: list[_Request], logits: torch.Tensor) -> None:
        """Draw each request's next token; a turn that stops resolves its future."""
        device = logits.device
        requests = torch.tensor([req.index for req in reqs], device=device)
        steps = torch.tensor([req.generated for req in reqs], device=device)
        tokens, log_probs = sample(logits, self.params, requests, steps)
        for req, token, log_prob in zip(reqs, tokens.tolist(), log_probs.tolist()):
            req.tokens.append(token)
            req.log_probs.append(log_prob)
            req.generated += 1
            stopped = token in self.stop_ids
            if stopped or len(req.tokens) >= req.budget:
                self._finish_turn(req, stopped)

    def _finish_turn(self, req: _Request, stopped: bool) -> None:
        future, req.future = req.future, None
        req.pending = [req.tokens[-1]]  # not cached yet: the next turn computes it first
        if not self.reuse_cache:
            req.history += req.tokens[:-1]
        self._stats.turns += 1
        routes = req.routes[: req.length].cpu().clone() if self.recording else None
        if not future.done():
            future.set_result(TurnOutput(list(req.tokens), list(req.log_probs), stopped, routes))

    def _compact(self) -> None:
        """Park the requests whose turn ended: slots 0..B'-1 hold exactly the ones still decoding (ragged
        decode: they only leave the decoding list, their keys/values stay where they are)."""
        done = [slot for slot, req in enumerate(self.active) if not req.decoding]
        if not done:
            return
        if self.ragged:
            finished = [req for req in self.active if not req.decoding]
            self.active = [req for req in self.active if req.decoding]
            for req in finished:
                if req.index not in self.requests:  # released meanwhile
                    self.owner[req.slot], req.slot = None, None
            return
        keep = len(self.active) - len(done)
        holes = [slot for slot in done if slot < keep]
        movers = [slot for slot in range(keep, len(self.active)) if self.active[slot].decoding]
        active = list(self.active)
        self.active = active[:keep]
        for hole, mover in zip(holes, movers):
            self._move(active[hole], self._free_slot())
            self._move(active[mover], hole)
            self.active[hole] = active[mover]
        for req in active:
            if not req.decoding and req.index not in self.requests:  # released meanwhile
                self.owner[req.slot], req.slot = None, None
