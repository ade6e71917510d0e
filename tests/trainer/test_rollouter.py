"""The rollouter's queue, admission control and bookkeeping, with real threads: a generator function stands
in for the rollout pool (the e2e tests run the real one) so that its speed, and the trainer's, can be set."""

import random
import threading
import time

import numpy as np
import pytest
import torch

from hybridflow.batch_keys import (
    ATTENTION_MASK,
    INDEX,
    INPUT_IDS,
    INTERRUPTED,
    POSITION_IDS,
    PROMPTS,
    RESPONSE_MASK,
    RESPONSES,
    TOKEN_VERSIONS,
    UID,
)
from hybridflow.protocol import DataProto
from hybridflow.trainer.asynchronous.partial_rollout import PartialRollout
from hybridflow.trainer.asynchronous.rollouter import FinishedGroup, Rollouter
from hybridflow.trainer.asynchronous.staleness import staleness_of
from hybridflow.trainer.services.timeline import StepTimeline

N = 2  # samples per prompt


def loader(n_prompts: int, batch: int, width_of=lambda b: 3 + b % 2, start: int = 0):
    """Batches of prompt rows like the dataset's collate: left-padded to each batch's own width."""
    for b in range(start, n_prompts // batch):
        width = width_of(b)
        ids = torch.arange(batch * width).reshape(batch, width) + 10
        mask = torch.ones(batch, width, dtype=torch.long)
        mask[:, 0] = 0  # one column of left padding
        yield DataProto.from_dict(
            {INPUT_IDS: ids, ATTENTION_MASK: mask, POSITION_IDS: (mask.cumsum(1) - 1).clamp(min=0)},
            non_tensors={INDEX: np.array([b * batch + i for i in range(batch)], dtype=object)},
        )


class Generator:
    """Rollouts of each prompt: n rows with the chunk's uids; records which version each chunk started under
    (read from the rollouter, as the rollout pool would hold it) and can be slow."""

    def __init__(self, seconds=lambda: 0.0):
        self.seconds = seconds
        self.rollouter: Rollouter | None = None
        self.chunk_sizes: list[int] = []

    def __call__(self, prompts: DataProto, chunk: int):
        time.sleep(self.seconds())
        self.chunk_sizes.append(len(prompts))
        rows = prompts.repeat(N, interleave=True)
        rows.non_tensor_batch[UID] = np.array([f"{chunk}-{i // N}" for i in range(len(rows))], dtype=object)
        rows.batch[RESPONSES] = torch.full((len(rows), 2), chunk)
        rows.batch[PROMPTS] = rows.batch[INPUT_IDS].clone()
        return rows, {"rollout/chunk": float(chunk)}, StepTimeline(chunk)


def make(
    generator, *, n_prompts=32, batch=4, chunk=4, eta=1, keep=None, width_of=lambda b: 3 + b % 2, start=0, policy="wait"
):
    rollouter = Rollouter(
        generate_chunk=generator,
        keep_groups=keep,
        loader_batches=iter(loader(n_prompts, batch, width_of, start)),
        batch_groups=batch,
        chunk_prompts=chunk,
        max_staleness=eta,
        pad_token_id=0,
        staleness_policy=policy,
    )
    generator.rollouter = rollouter
    return rollouter


def train(rollouter, steps, seconds=lambda: 0.0, push_every=1, dropped=None):
    """The trainer's side: take, 'train', push; returns per step the (index, version) of each group."""
    seen = []
    for step in range(1, steps + 1):
        taken = rollouter.take(step)
        if taken is None:
            break
        if dropped is not None:
            dropped.append(taken.dropped)
        seen.append([(int(g.prompt.non_tensor_batch[INDEX][0]), g.version) for g in taken.groups])
        time.sleep(seconds())
        if step % push_every == 0:
            with rollouter.paused():
                rollouter.set_version(step)
    return seen


@pytest.mark.parametrize("eta", [0, 1, 3])
@pytest.mark.parametrize("slow", ["trainer", "rollouter"])
def test_the_bound_holds_under_a_slow_side(eta, slow):
    rng = random.Random(eta)
    jitter = lambda: rng.uniform(0.0, 0.004)  # noqa: E731
    slow_side = lambda: 0.01 + jitter()  # noqa: E731
    generator = Generator(slow_side if slow == "rollouter" else jitter)
    rollouter = make(generator, chunk=2, eta=eta)
    rollouter.start()
    seen = train(rollouter, steps=8, seconds=slow_side if slow == "trainer" else jitter)
    assert rollouter.stop(5.0)
    assert len(seen) == 8
    stalenesses = [staleness_of(step, version) for step, groups in enumerate(seen, 1) for _, version in groups]
    assert max(stalenesses) <= eta
    if slow == "trainer" and eta > 0:
        assert max(stalenesses) == eta  # a fast rollouter runs as far ahead as the bound lets it
    indices = [index for groups in seen for index, _ in groups]
    assert sorted(indices) == list(range(32))  # every prompt once, in order of the loader
    assert indices == list(range(32))


@pytest.mark.parametrize("policy", ["wait", "drop"])
def test_the_drop_policy_generates_ahead_and_drops_what_went_stale(policy):
    """A fast rollouter, a slow trainer, η = 1: waiting, the rollout never starts a group that would train over
    the bound; dropping, it fills the queue with the old weights between a take and the push, and the trainer
    drops those groups when they come up two versions stale, their prompts generated again: either way no group
    trains over the bound and every prompt trains exactly once."""
    generator = Generator()
    rollouter = make(generator, chunk=2, eta=1, policy=policy)
    rollouter.start()
    dropped: list[int] = []
    seen = train(rollouter, steps=20, seconds=lambda: 0.05, dropped=dropped)
    assert rollouter.stop(5.0)
    stalenesses = [staleness_of(step, version) for step, groups in enumerate(seen, 1) for _, version in groups]
    assert max(stalenesses) == 1
    assert sorted(index for groups in seen for index, _ in groups) == list(range(32))
    generated = sum(generator.chunk_sizes)
    if policy == "wait":
        assert sum(dropped) == 0 and generated == 32  # nothing generated in vain
    else:
        assert sum(dropped) > 0 and generated == 32 + sum(dropped)  # each dropped group generated again
        assert len(seen) == 8


def test_no_staleness_alternates_generation_and_training():
    generator = Generator()
    rollouter = make(generator, eta=0)
    rollouter.start()
    seen = train(rollouter, steps=4)
    rollouter.stop(5.0)
    assert [[v for _, v in groups] for groups in seen] == [[0] * 4, [1] * 4, [2] * 4, [3] * 4]


def test_the_trainer_waits_without_a_push():
    """Without a push the rollout may not start more than η + 1 batches: the trainer's next take finds nothing."""
    rollouter = make(Generator(), eta=1)
    rollouter.start()
    assert rollouter.take(1) is not None and rollouter.take(2) is not None
    time.sleep(0.2)
    with rollouter.lock:
        assert not rollouter.queue and rollouter.in_flight is None and rollouter.capacity() == 0
    rollouter.set_version(1)
    assert rollouter.take(3) is not None
    rollouter.stop(5.0)


def test_prompts_of_different_widths_join_into_one_chunk():
    rollouter = make(Generator(), chunk=8, batch=4, eta=1, width_of=lambda b: 3 + b)
    rollouter.start()
    groups = rollouter.take(1).groups + rollouter.take(2).groups
    rollouter.stop(5.0)
    assert [int(g.prompt.non_tensor_batch[INDEX][0]) for g in groups] == list(range(8))
    # the second loader batch is one column wider: the first's rows were left-padded to it
    first = groups[0].rows.batch
    assert first[INPUT_IDS].shape[1] == 4 and first[ATTENTION_MASK][0].tolist() == [0, 0, 1, 1]


def test_a_resume_with_a_smaller_bound_drops_and_requeues():
    """Groups over the bound are dropped when taken, their prompts generated again by newer weights."""
    generator = Generator()
    rollouter = make(generator, eta=2)
    rollouter.start()
    assert rollouter.take(1) is not None
    time.sleep(0.2)  # the rollouter fills the room the bound gives: 2 more batches of version 0
    state = rollouter.snapshot(lambda: {})
    rollouter.stop(5.0)
    assert len(state["queue"]) == 8 and {g.version for g in state["queue"]} == {0}

    resumed = make(Generator(), eta=0, start=3)  # the loader resumes after the 12 prompts drawn
    resumed.restore(state)
    resumed.rollout_version = 3  # the checkpoint's weights, after step 3 (pretend)
    resumed.start()
    takes = []
    for step in (4, 5, 6):
        takes.append(resumed.take(step))
        resumed.set_version(step)
    resumed.stop(5.0)
    assert takes[0].dropped == 8 and takes[1].dropped == takes[2].dropped == 0  # all 8 were 3 versions stale
    assert [[g.version for g in t.groups] for t in takes] == [[3] * 4, [4] * 4, [5] * 4]
    # the dropped prompts were generated again: none lost, none twice
    indices = [int(g.prompt.non_tensor_batch[INDEX][0]) for t in takes for g in t.groups]
    assert sorted(indices) == list(range(4, 16))
    assert resumed.step_counters()["async/requeued_groups"] == 8


def test_dynamic_sampling_uses_up_groups_and_frees_their_room():
    keep_even = lambda batch: {uid for uid in batch.non_tensor_batch[UID] if int(uid.split("-")[1]) % 2 == 0}  # noqa: E731
    generator = Generator()
    rollouter = make(generator, eta=0, keep=keep_even)
    rollouter.start()
    taken = rollouter.take(1)
    rollouter.stop(5.0)
    assert [int(g.prompt.non_tensor_batch[INDEX][0]) for g in taken.groups] == [0, 2, 4, 6]
    # room for 4: a chunk of 4 keeps 2 (prompts 0, 2), one of the 2 left keeps 1 (4), then one of 1 (6)
    assert generator.chunk_sizes == [4, 2, 1]
    assert rollouter.step_counters()["dynamic_sampling/dropped_groups"] == 3


def test_the_snapshot_holds_every_prompt_exactly_once():
    """At any instant: trained + queued + in flight + waiting + still in the loader = the data set, once each."""
    generator = Generator(lambda: 0.003)
    rollouter = make(generator, chunk=2, eta=1)
    trained: list[int] = []
    rollouter.start()
    for step in range(1, 6):
        taken = rollouter.take(step)
        trained += [int(g.prompt.non_tensor_batch[INDEX][0]) for g in taken.groups]
        state = rollouter.snapshot(lambda: {})
        queued = [int(g.prompt.non_tensor_batch[INDEX][0]) for g in state["queue"]]
        waiting = [int(p.non_tensor_batch[INDEX][0]) for p in state["backlog"]]
        drawn = trained + queued + waiting
        assert len(drawn) == len(set(drawn))
        assert sorted(drawn) == list(range(len(drawn)))  # nothing drawn from the loader is missing
        rollouter.set_version(step)
    rollouter.stop(5.0)


def test_a_failing_generation_reaches_the_trainer():
    def broken(prompts, chunk):
        raise RuntimeError("rollout rank 0 died")

    rollouter = make(Generator(), eta=1)
    rollouter.generate_chunk = broken
    rollouter.start()
    with pytest.raises(RuntimeError, match="rollout rank 0 died"):
        rollouter.take(1)
    assert rollouter.stop(5.0)


def test_the_end_of_the_data_ends_the_takes():
    rollouter = make(Generator(), n_prompts=8, eta=3)
    rollouter.start()
    assert rollouter.take(1) is not None and rollouter.take(2) is not None
    assert rollouter.take(3) is None
    assert rollouter.stop(5.0)


def test_finished_group_is_picklable():
    import pickle

    group = FinishedGroup(next(loader(4, 4)), next(loader(4, 4))[0:1], 3, 1)
    assert pickle.loads(pickle.dumps(group)).version == 3


class CutFirstChunk(Generator):
    """Partial rollout: the first chunk comes back with each prompt's second sample cut after 2 of its 4 tokens
    (as a push would cut it: the rollout holds version 1 by the time the call returns)."""

    def __call__(self, prompts, chunk):
        rows, metrics, timeline = super().__call__(prompts, chunk)
        rows.batch[RESPONSES] = torch.full((len(rows), 4), chunk)
        cut = torch.tensor([chunk == 1 and i % N == 1 for i in range(len(rows))])
        rows.batch[RESPONSE_MASK] = torch.where(cut[:, None], torch.tensor([[1, 1, 0, 0]]), torch.ones(1, 4)).long()
        rows.batch[INTERRUPTED] = cut
        if chunk == 1:
            self.rollouter.set_version(1)
        return rows, metrics, timeline


def finish_rows(rows, call):
    """The continuation: every cut row generated to the end."""
    done = rows.select(deepcopy=True)
    done.batch[RESPONSE_MASK] = torch.ones_like(done.batch[RESPONSE_MASK])
    done.batch[INTERRUPTED] = torch.zeros(len(done), dtype=torch.bool)
    return done, {}, StepTimeline(call)


def test_partial_rollout_continues_cut_samples_first_and_tags_their_tokens():
    generator = CutFirstChunk()
    continued_calls = []
    partial = PartialRollout(
        interrupt=lambda call: None, continue_rows=lambda r, c: continued_calls.append(c) or finish_rows(r, c)
    )
    rollouter = make(generator, eta=1)
    rollouter.partial = partial
    rollouter.start()
    taken = rollouter.take(1)
    rollouter.stop(5.0)
    assert continued_calls == [2]  # the call after the cut one continued its samples, before any new prompt
    assert [int(g.prompt.non_tensor_batch[INDEX][0]) for g in taken.groups] == [0, 1, 2, 3]
    for group in taken.groups:
        assert group.version == 0  # its oldest token's
        assert group.rows.batch[TOKEN_VERSIONS].tolist() == [[0, 0, 0, 0], [0, 0, 1, 1]]
    assert rollouter.step_counters()["async/continued_samples"] == 4


def test_a_snapshot_holds_open_groups_as_prompts_to_generate_again():
    generator = CutFirstChunk()
    gate = threading.Event()

    def continue_later(rows, call):
        gate.wait(5.0)
        return finish_rows(rows, call)

    rollouter = make(generator, eta=0)
    rollouter.partial = PartialRollout(interrupt=lambda call: None, continue_rows=continue_later)
    rollouter.start()
    deadline = time.time() + 5
    while not rollouter.open and time.time() < deadline:
        time.sleep(0.01)
    state = rollouter.snapshot(lambda: {})
    gate.set()
    assert rollouter.take(1) is not None
    rollouter.stop(5.0)
    # the 4 prompts were all cut (each group has a sample in flight): all come back as prompts, none queued
    assert state["queue"] == []
    assert sorted(int(p.non_tensor_batch[INDEX][0]) for p in state["backlog"]) == [0, 1, 2, 3]


def test_a_rollouter_state_written_before_the_trainer_was_split_still_reads(monkeypatch):
    """Checkpoints of fully async runs pickled FinishedGroup as hybridflow.trainer.rollouter.FinishedGroup; the
    module moved to trainer/asynchronous/, and a resume reads the old name through the loop's unpickler."""
    import pickle
    import sys

    from hybridflow.trainer.asynchronous import rollouter as new_module
    from hybridflow.trainer.loop.async_queue import read_rollouter_state

    rows = DataProto.from_dict({RESPONSES: torch.arange(6).reshape(2, 3)})
    group = FinishedGroup(rows=rows, prompt=rows[:1], version=3, chunk=7)
    with monkeypatch.context() as old_layout:  # pickle as the old layout did
        old_layout.setitem(sys.modules, "hybridflow.trainer.rollouter", new_module)
        old_layout.setattr(FinishedGroup, "__module__", "hybridflow.trainer.rollouter")
        old = pickle.dumps({"queue": [group], "consumed": 4})
    assert b"hybridflow.trainer.rollouter" in old and b"asynchronous" not in old
    with pytest.raises(ModuleNotFoundError):
        pickle.loads(old)
    state = read_rollouter_state(old)
    (restored,) = state["queue"]
    assert isinstance(restored, FinishedGroup) and (restored.version, restored.chunk) == (3, 7)
    assert torch.equal(restored.rows.batch[RESPONSES], rows.batch[RESPONSES]) and state["consumed"] == 4
