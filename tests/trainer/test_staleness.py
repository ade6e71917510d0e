"""The admission rule and staleness statistics of fully asynchronous training, against hand-computed values."""

import pytest

from hybridflow.trainer.asynchronous.staleness import (
    admission_capacity,
    check_push_schedule,
    queue_capacity,
    staleness_metrics,
    staleness_of,
)


def room(**state) -> int:
    return admission_capacity(batch_groups=4, **state)


def test_admission_capacity_by_hand():
    # η=1, batch 4, rollout at version 0: two batches may be started before any is trained
    assert room(max_staleness=1, rollout_version=0, consumed=0, queued=0, in_flight=0) == 8
    # 4 queued and 2 in flight leave 2
    assert room(max_staleness=1, rollout_version=0, consumed=0, queued=4, in_flight=2) == 2
    # the trainer took the first batch (consumed 4) but the rollout still holds version 0: no more room than before
    assert room(max_staleness=1, rollout_version=0, consumed=4, queued=2, in_flight=2) == 0
    # the push of version 1 opens one batch more
    assert room(max_staleness=1, rollout_version=1, consumed=4, queued=2, in_flight=2) == 4
    # η=0: only the batch the current weights will train
    assert room(max_staleness=0, rollout_version=3, consumed=12, queued=0, in_flight=0) == 4


def test_the_drop_policy_bounds_only_the_queue():
    # η=1, batch 4: two batches queued or in flight, whatever the rollout's weights and the trainer's progress
    assert queue_capacity(max_staleness=1, batch_groups=4, queued=0, in_flight=0) == 8
    assert queue_capacity(max_staleness=1, batch_groups=4, queued=2, in_flight=2) == 4
    # where admission control waits for the push (consumed 4, version 0: no room), the bounded queue does not
    assert room(max_staleness=1, rollout_version=0, consumed=4, queued=2, in_flight=2) == 0
    assert queue_capacity(max_staleness=1, batch_groups=4, queued=2, in_flight=2) == 4


def test_staleness_of_a_sample():
    assert staleness_of(train_step=1, generated_by=0) == 0  # step 1 trains version 0
    assert staleness_of(train_step=5, generated_by=2) == 2


def test_push_schedule():
    assert check_push_schedule(max_staleness=0, push_every=1) is None
    assert check_push_schedule(max_staleness=2, push_every=3) is None
    reason = check_push_schedule(max_staleness=1, push_every=3)
    assert reason is not None and "wait forever" in reason


def test_staleness_metrics_and_histogram():
    metrics = staleness_metrics([0, 1, 1, 2], max_staleness=2)
    assert metrics["async/staleness/mean"] == pytest.approx(1.0)
    assert metrics["async/staleness/min"] == 0.0 and metrics["async/staleness/max"] == 2.0
    assert [metrics[f"async/staleness/frac_{k}"] for k in range(3)] == [0.25, 0.5, 0.25]
    # over the bound (should not happen): the histogram still shows it
    assert staleness_metrics([3], max_staleness=1)["async/staleness/frac_3"] == 1.0
    assert staleness_metrics([], max_staleness=1) == {}
