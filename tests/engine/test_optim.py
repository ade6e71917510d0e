import math

import pytest

from hybridflow.engine.optim import OptimConfig, lr_multiplier

ADAMW = {"lr": 1e-6, "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-8}


def test_warmup_then_constant():
    config = OptimConfig(**ADAMW, lr_warmup_steps=4, lr_scheduler="constant", min_lr_ratio=0.0)
    assert [lr_multiplier(s, config, 10) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_warmup_then_cosine_to_min_ratio():
    config = OptimConfig(**ADAMW, lr_warmup_steps=2, lr_scheduler="cosine", min_lr_ratio=0.1)
    # after warm-up, progress p = (step - 2) / (10 - 2); multiplier = 0.1 + 0.9 * (1 + cos(pi p)) / 2
    assert lr_multiplier(2, config, 10) == pytest.approx(1.0)
    assert lr_multiplier(6, config, 10) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_multiplier(10, config, 10) == pytest.approx(0.1)
    assert lr_multiplier(4, config, 10) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2)
