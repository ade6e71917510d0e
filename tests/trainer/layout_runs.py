"""Whole runs in two layouts of the same ranks, compared metric by metric: what the sequence- and pipeline-parallel
end-to-end tests share. A ``mode`` of tests/trainer/test_kill_and_resume.py splits the models (its ``MODES`` entry);
``baseline`` overrides set the same models back to data parallelism over the same ranks."""

import torch
from test_kill_and_resume import args, comparable, records
from transformers import AutoModelForCausalLM

from hybridflow.cli import main as cli
from hybridflow.data.tasks import write_task

# a reward every response earns some of (the arithmetic task's is 0 for an untrained tiny model, and so would be the
# critic's targets): its digits and its length
DENSE_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isdigit() for c in solution_str) / max(1, len(solution_str)) + len(solution_str) / 100
"""


def assert_same_metrics(got: dict, want: dict, steps: list[int], layout_bound: tuple[str, ...] = ()) -> None:
    """Every comparable metric of each step equal up to float rounding, but those the layout sets
    (``layout_bound``)."""
    for step in steps:
        have, expected = comparable(got[step]), comparable(want[step])
        for key in layout_bound:
            have.pop(key), expected.pop(key)
        assert have.keys() == expected.keys() and len(expected) > 30
        for key, value in expected.items():
            assert abs(have[key] - value) <= 1e-5 * max(1.0, abs(value)), (step, key, have[key], value)


def assert_same_exports(split_run, whole_run, out) -> None:
    """``hybridflow export`` of a split run's checkpoint of step 4 writes one Hugging Face model transformers loads,
    with the weights of the same step of the run without the split: to 1e-3, the rounding that a few Adam steps grow
    from the two layouts' float sums (the metrics agree to 1e-5); a weight missing, or from another step or stage,
    differs by what training moves it, over 10x that (the split run's step 2 against its step 4, checked)."""
    exported = {}
    for name, checkpoint in (("split", split_run / "global_step_4"), ("whole", whole_run / "global_step_4")):
        assert cli(["export", str(checkpoint), str(out / name)]) == 0
        exported[name] = AutoModelForCausalLM.from_pretrained(out / name, dtype=torch.float32).state_dict()
    assert exported["split"].keys() == exported["whole"].keys()
    for key, want in exported["whole"].items():
        torch.testing.assert_close(exported["split"][key], want, rtol=0, atol=1e-3, msg=key)
    assert cli(["export", str(split_run / "global_step_2"), str(out / "earlier")]) == 0
    earlier = AutoModelForCausalLM.from_pretrained(out / "earlier", dtype=torch.float32).state_dict()
    assert max((earlier[key] - want).abs().max() for key, want in exported["split"].items()) > 1e-2


def task_files(tmp_path):
    data = tmp_path / "data"
    write_task("arithmetic", data, train=8, test=4, seed=0)
    return data / "train.parquet", data / "test.parquet"


def grpo_equals_data_parallel(
    tmp_path, mode: str, baseline: list[str], both: tuple[str, ...] = (), layout_bound: tuple[str, ...] = ()
) -> dict:
    """GRPO (no critic; the actor and its reference split) against the baseline, 3 steps, the task's own reward;
    ``both``: overrides of both runs; ``layout_bound``: metrics the layout sets, not compared. Both runs' records."""
    files = task_files(tmp_path)
    grpo = [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.total_training_steps=3",
        *both,
    ]
    runs = {}
    for name, extra in (("baseline", baseline), ("split", [])):
        assert cli(["train", *args(files, tmp_path / name, mode), *grpo, *extra]) == 0
        runs[name] = records(tmp_path / name)
    assert sorted(runs["split"]) == sorted(runs["baseline"]) == [1, 2, 3]
    assert "critic/vf_loss" not in runs["split"][1] and runs["split"][3]["actor/kl_loss"] > 0  # the policy moved
    assert_same_metrics(runs["split"], runs["baseline"], [1, 2, 3], layout_bound)
    return runs


def ppo_equals_data_parallel_and_resumes_there(
    tmp_path, mode: str, baseline: list[str], both: tuple[str, ...] = (), layout_bound: tuple[str, ...] = ()
) -> dict:
    """PPO with GAE (the actor, its reference and the critic split) against the baseline, 4 steps of a dense reward;
    then the split run's checkpoint of step 2 resumes in the baseline's layout to the split run's steps 3 and 4.
    ``both``: overrides of every run; ``layout_bound``: metrics the layout sets, not compared. The split run's
    records."""
    files = task_files(tmp_path)
    reward = tmp_path / "dense_reward.py"
    reward.write_text(DENSE_REWARD)
    # one optimizer step per training step: which rows share a mini-batch depends on how they split over the
    # data-parallel ranks (engine/update.py), 2 in the baseline and 1 split
    whole_batch = ["actor_rollout_ref.actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4"]

    def run(run_dir, *extra) -> int:
        scoring = f"custom_reward_function.path={reward}"
        return cli(["train", *args(files, run_dir, mode), scoring, *whole_batch, *both, *extra])

    data_parallel, split = tmp_path / "baseline", tmp_path / "split"
    assert run(data_parallel, *baseline) == 0
    assert run(split) == 0
    want, got = records(data_parallel), records(split)
    assert sorted(want) == sorted(got) == [1, 2, 3, 4]
    assert all(got[step]["critic/vf_loss"] > 0 for step in got)  # the critic learns something
    assert_same_metrics(got, want, [1, 2, 3, 4], layout_bound)

    assert_same_exports(split, data_parallel, tmp_path / "exported")

    resumed = tmp_path / "resumed"
    assert run(resumed, *baseline, f"trainer.resume_mode={split / 'global_step_2'}") == 0
    after = records(resumed)
    assert sorted(after) == [3, 4]
    assert_same_metrics(after, got, [3, 4], layout_bound)
    return got
