import math

import pytest

from hybridflow.trainer.services.val_metrics import k_values, pass_at_k, validation_metrics


def test_pass_at_k_by_hand():
    # n=4, c=1: pass@1 = 1 - C(3,1)/C(4,1) = 1/4; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6; pass@4 = 1 (C(3,4) = 0)
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 1, 4) == 1.0
    # n=4, c=2: pass@2 = 1 - C(2,2)/C(4,2) = 5/6
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)
    assert pass_at_k(4, 0, 4) == 0.0
    # n=10, c=3, k=5: 1 - C(7,5)/C(10,5) = 1 - 21/252
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - math.comb(7, 5) / math.comb(10, 5))
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_k_values():
    assert k_values(1) == [1]
    assert k_values(8) == [1, 2, 4, 8]
    assert k_values(6) == [1, 2, 4, 6]


def test_single_sample_gives_means_only():
    metrics = validation_metrics(["a", "a", "b"], ["0", "1", "2"], [1.0, 0.0, 0.5], n=1)
    assert metrics == {"val/a/score_mean": 0.5, "val/b/score_mean": 0.5, "val/score/mean": 0.5}


def test_pass_and_mean_at_n_per_source():
    # source "math": prompt p0 scores [1,0,0,0] (c=1), p1 [1,1,0,0] (c=2); source "code": p2 [0,0,0,0], p3 [1,1,1,1]
    sources = ["math"] * 8 + ["code"] * 8
    uids = ["p0"] * 4 + ["p1"] * 4 + ["p2"] * 4 + ["p3"] * 4
    scores = [1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1]
    metrics = validation_metrics(sources, uids, scores, n=4)
    assert metrics["val/math/score_mean"] == pytest.approx(3 / 8)
    assert metrics["val/code/score_mean"] == pytest.approx(0.5)
    assert metrics["val/score/mean"] == pytest.approx(7 / 16)
    assert metrics["val/math/mean@4"] == pytest.approx((0.25 + 0.5) / 2)
    assert metrics["val/math/pass@1"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    assert metrics["val/math/pass@2"] == pytest.approx((1 / 2 + 5 / 6) / 2)
    assert metrics["val/math/pass@4"] == 1.0
    assert metrics["val/code/pass@1"] == pytest.approx(0.5)
    assert metrics["val/code/pass@2"] == pytest.approx(0.5)
    assert metrics["val/code/pass@4"] == pytest.approx(0.5)
    assert "val/math/pass@3" not in metrics


def test_threshold_defines_correct():
    # scores 0.9 and 0.4: with the default threshold 1.0 nothing is correct; with 0.5 one sample of two is
    assert validation_metrics(["s"] * 2, ["u"] * 2, [0.9, 0.4], n=2)["val/s/pass@1"] == 0.0
    assert validation_metrics(["s"] * 2, ["u"] * 2, [0.9, 0.4], n=2, threshold=0.5)["val/s/pass@1"] == pytest.approx(
        0.5
    )
    assert (
        validation_metrics(["s"] * 2, ["u"] * 2, [1.0 - 1e-9, 0.0], n=2)["val/s/pass@2"] == 1.0
    )  # float noise tolerated


def test_reused_uid_is_an_error():
    # two validation batches that both number their prompts from 0 would merge two prompts into one group
    with pytest.raises(ValueError, match="unique per prompt"):
        validation_metrics(["s"] * 4, ["0-0"] * 4, [1, 0, 1, 0], n=2)
    with pytest.raises(ValueError, match="lengths differ"):
        validation_metrics(["s"], ["u", "v"], [1.0], n=1)
    assert validation_metrics([], [], [], n=4) == {}
