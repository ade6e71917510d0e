"""On-policy distillation through real Ray worker groups on a pair of tiny models: the teacher's worker group scores
the student's samples, and the advantage the update trains with is -(log π_student - log π_teacher) on the generated
tokens, checked against log-probs computed by hand with plain transformers; a teacher equal to the student changes
nothing; multi-turn samples are scored in their conversation's context; the asynchronous modes distil too."""

import json
import math

import pytest
import torch
from agent_loops import CALCULATE_THEN_ANSWER
from safetensors.torch import load_file

from hybridflow.batch_keys import (
    ADVANTAGES,
    ATTENTION_MASK,
    GENERATED_MASK,
    INPUT_IDS,
    OLD_LOG_PROBS,
    RESPONSE_MASK,
    RESPONSES,
    TEACHER_LOG_PROB,
)
from hybridflow.models import load_causal_lm, resolve_model_path
from hybridflow.trainer.commands.export import export_checkpoint
from hybridflow.trainer.commands.train import run
from hybridflow.trainer.loop.rl_trainer import RLTrainer
from hybridflow.trainer.setup.config import load_config

pytestmark = pytest.mark.slow

KEPT = (INPUT_IDS, ATTENTION_MASK, RESPONSES, RESPONSE_MASK, GENERATED_MASK, OLD_LOG_PROBS, TEACHER_LOG_PROB)


def teacher_dir() -> str:
    """tiny-llama initialised from another seed: the same tokenizer, other weights."""
    return str(resolve_model_path("tiny-llama", seed=1))


@pytest.fixture
def captured(monkeypatch) -> list[dict[str, torch.Tensor]]:
    """The columns of every batch the driver computes advantages for (the driver runs in this process)."""
    batches: list[dict[str, torch.Tensor]] = []
    compute_advantage = RLTrainer.compute_advantage

    def recording(self, batch, metrics):
        compute_advantage(self, batch, metrics)
        batches.append({key: batch.batch[key].clone() for key in (*KEPT, ADVANTAGES) if key in batch.batch.keys()})

    monkeypatch.setattr(RLTrainer, "compute_advantage", recording)
    return batches


def distil(arithmetic_files, run_dir, *extra: str) -> list[dict]:
    train, test = arithmetic_files
    config = load_config(
        [
            f"data.train_files=[{train}]",
            f"data.val_files=[{test}]",
            "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.response_length=8",
            "actor_rollout_ref.actor.fsdp.param_dtype=fp32",  # the hand computation's dtype, on any host
            "teacher.fsdp.param_dtype=fp32",
            f"teacher.model.path={teacher_dir()}",
            "trainer.val_before_train=false",
            "trainer.total_training_steps=1",
            "trainer.logger=[jsonl]",
            f"trainer.default_local_dir={run_dir}",
            *extra,
        ]
    )
    run(config)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@torch.no_grad()
def log_probs_by_hand(model_path: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each response token's log-prob under the model, in its whole sequence's context (prompt, and in a multi-turn
    sample the turns and tool output before it): one plain forward per row over its real tokens, fp32."""
    model = load_causal_lm(model_path).eval()
    ids, mask, responses = batch[INPUT_IDS], batch[ATTENTION_MASK], batch[RESPONSES]
    prompt_length = ids.shape[1] - responses.shape[1]
    out = torch.zeros(responses.shape, dtype=torch.float32)
    for row in range(ids.shape[0]):
        real = mask[row].bool()
        positions = real.nonzero().squeeze(1)
        logits = model(ids[row, real][None]).logits[0].float()
        log_probs = torch.log_softmax(logits, dim=-1)
        for column in range(responses.shape[1]):
            index = prompt_length + column
            if not real[index]:
                continue
            at = int((positions == index).nonzero())  # the token's place among the real ones
            out[row, column] = log_probs[at - 1, ids[row, index]]
    return out


def test_the_advantage_is_the_teacher_s_log_probs_minus_the_student_s(local_ray, arithmetic_files, tmp_path, captured):
    records = distil(arithmetic_files, tmp_path / "run")
    (batch,) = captured
    mask = batch[RESPONSE_MASK].bool()
    student = log_probs_by_hand(str(resolve_model_path("tiny-llama")), batch)
    teacher = log_probs_by_hand(teacher_dir(), batch)
    torch.testing.assert_close(batch[TEACHER_LOG_PROB][mask], teacher[mask], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(batch[OLD_LOG_PROBS][mask], student[mask], atol=2e-5, rtol=1e-5)
    expected = torch.where(mask, teacher - student, 0.0)
    torch.testing.assert_close(batch[ADVANTAGES], expected, atol=4e-5, rtol=1e-5)
    assert expected[mask].abs().min() > 0  # the models differ on every token: the check is not of zeros
    step = records[-1]
    delta = (student - teacher)[mask]
    assert step["distill/reverse_kl_mean"] == pytest.approx(delta.mean().item(), abs=1e-4)
    assert step["distill/advantage_share"] == 1.0  # reward_coef=0: distillation alone
    assert step["timing_s/teacher"] > 0 and step["perf/tflops_teacher_log_prob"] > 0


def test_a_teacher_equal_to_the_student_gives_zero_and_leaves_the_weights(
    local_ray, arithmetic_files, tmp_path, captured
):
    """No task reward and the student's own weights as the teacher: every advantage is 0, so is every gradient, and
    AdamW without weight decay leaves the weights bitwise as they were."""
    run_dir = tmp_path / "run"
    student = str(resolve_model_path("tiny-llama"))
    records = distil(
        arithmetic_files,
        run_dir,
        f"teacher.model.path={student}",
        "trainer.total_training_steps=2",
        "trainer.save_freq=2",
        "actor_rollout_ref.actor.optim.weight_decay=0",
    )
    assert len(captured) == 2
    for batch in captured:
        assert batch[ADVANTAGES].abs().max().item() == 0.0
        assert torch.equal(batch[TEACHER_LOG_PROB], batch[OLD_LOG_PROBS])
    for step in records:
        assert step["distill/reverse_kl_mean"] == 0.0 and step["actor/grad_norm"] == 0.0
    exported = export_checkpoint(run_dir, tmp_path / "exported")
    trained = load_file(str(exported / "model.safetensors"))
    initial = load_causal_lm(student).state_dict()
    assert trained.keys() <= initial.keys() and len(trained) > 10
    for name, tensor in trained.items():
        assert torch.equal(tensor, initial[name]), name


def test_multi_turn_samples_are_scored_in_their_conversation(local_ray, arithmetic_files, tmp_path, captured):
    """Two generated turns around a tool's answer: the teacher scores each generated token after everything before it
    (the tool's tokens included), and the inserted tokens get no advantage."""
    (tmp_path / "loop.py").write_text(CALCULATE_THEN_ANSWER)
    (tmp_path / "tools.yaml").write_text("tools:\n  - name: calculator\n")
    distil(
        arithmetic_files,
        tmp_path / "run",
        "actor_rollout_ref.rollout.response_length=32",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.default_agent={tmp_path / 'loop.py'}:CalculateThenAnswer",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}",
    )
    (batch,) = captured
    generated, inserted = (
        batch[RESPONSE_MASK].bool(),
        batch[ATTENTION_MASK][:, -32:].bool() & ~batch[GENERATED_MASK].bool(),
    )
    assert inserted.sum(dim=1).min() > 0  # every sample holds the tool's tokens
    teacher = log_probs_by_hand(teacher_dir(), batch)
    student = log_probs_by_hand(str(resolve_model_path("tiny-llama")), batch)
    torch.testing.assert_close(batch[TEACHER_LOG_PROB][generated], teacher[generated], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(batch[ADVANTAGES], torch.where(generated, teacher - student, 0.0), atol=4e-5, rtol=1e-5)
    assert batch[ADVANTAGES][inserted].abs().max() == 0


ASYNC_MODES = {
    "one_step_off": ["trainer.async_training.mode=one_step_off"],
    "fully_async": ["trainer.async_training.mode=fully_async", "trainer.async_training.max_staleness=1"],
}


@pytest.mark.parametrize("mode", sorted(ASYNC_MODES))
def test_asynchronous_modes_distil(local_ray, arithmetic_files, tmp_path, captured, mode):
    """Generation on a pool of its own, the teacher on another: each step's advantage is the frozen teacher's
    log-probs (checked by hand) minus the trainer's, mixed with the task reward's."""
    records = distil(
        arithmetic_files,
        tmp_path / "run",
        *ASYNC_MODES[mode],
        "trainer.total_training_steps=3",
        "trainer.placement=separate",
        "trainer.n_workers_per_node=1",
        "algorithm.distillation.reward_coef=0.5",
        "algorithm.rollout_correction.rollout_is=token",  # the batches are a version late
    )
    assert len(captured) == 3 and [r["step"] for r in records] == [1, 2, 3]
    for batch, step in zip(captured, records):
        mask = batch[RESPONSE_MASK].bool()
        teacher = log_probs_by_hand(teacher_dir(), batch)
        torch.testing.assert_close(batch[TEACHER_LOG_PROB][mask], teacher[mask], atol=2e-5, rtol=1e-5)
        delta = (batch[OLD_LOG_PROBS] - batch[TEACHER_LOG_PROB])[mask]
        assert step["distill/reverse_kl_mean"] == pytest.approx(delta.mean().item(), abs=1e-5)
        assert 0 < step["distill/advantage_share"] <= 1 and math.isfinite(step["actor/pg_loss"])
