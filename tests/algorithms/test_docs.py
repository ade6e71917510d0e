"""docs/algorithms.md names every built-in estimator, loss, KL type and aggregation mode."""

from pathlib import Path

from hybridflow.algorithms import AGG_MODES, KL_TYPES, list_adv_estimators, list_policy_losses

DOC = Path(__file__).resolve().parents[2] / "docs" / "algorithms.md"


def test_every_name_is_documented():
    text = DOC.read_text()
    names = [n for n in list_adv_estimators() + list_policy_losses() if not n.startswith("test_")]
    missing = [n for n in [*names, *KL_TYPES, *AGG_MODES] if f"`{n}`" not in text]
    assert not missing, f"not in {DOC.name}: {missing}"
