"""Short runs through the service equal the same steps through hybridflow's own trainers (LoRA, fp32, one worker
each): the same loss at every step and the same adapters at the end (absolute 1e-5).

- SFT: ``hybridflow sft``'s batches (unshuffled), as ``cross_entropy`` datums weighted by 1 / (trained tokens of the
  batch), so that the API's summed loss is the trainer's token mean (relative 1e-5).
- RL: ``hybridflow train`` (GRPO, one mini-batch a step) writes each step's batch (``trainer.rollout_data_dir``); its
  samples go through the service as ``importance_sampling`` datums with the trainer's old log-probs as the sampler's
  and the advantages weighted by 1 / (response tokens of the batch). The trainer's update is on-policy (ratio 1), so
  its PPO loss and gradient are REINFORCE's: the API's loss is the trainer's token-mean ``actor/pg_loss`` (within
  1e-6, the service's log-probs of the same tokens being the trainer's within 1e-5).

The two sides must start from the same adapters: the trainer's initial ones (its run with lr 0, exported) are filed
under the service's storage as a saved state of this test's key, and the service's model starts from that path.
AdamW, its settings and the gradient clip are the trainer's."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from service_helpers import KEY, MODEL
from tinker import types

from hybridflow.data.io import write_rows
from hybridflow.data.sft_dataset import SFTDataset
from hybridflow.data.tasks import write_task
from hybridflow.data.tasks.arithmetic import make_rows
from hybridflow.data.token_rows import token_mean_batch
from hybridflow.engine.adapter_slots import ADAPTER_FILE
from hybridflow.models import load_tokenizer, resolve_model_path
from hybridflow.models.adapters import ATTN, MLP
from hybridflow.serve.storage import META_FILE, owner_of
from hybridflow.trainer.services.rollout_data import read_rollout_data
from hybridflow.trainer.setup.sft_config import load_sft_config

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]

RANK, ALPHA, LR, BATCH, STEPS = 4, 8.0, 2e-3, 4, 3
ADAMW = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
CLIP = 1.0


def conversations(count: int) -> list[dict]:
    rows = make_rows(count, split="train", seed=3)
    answer = [{"role": "assistant", "content": r["reward_model"]["ground_truth"]} for r in rows]
    return [{"messages": [*r["prompt"], a]} for r, a in zip(rows, answer)]


def adamw_args(section: str, lr: float) -> list[str]:
    return [
        f"{section}.lr={lr}",
        f"{section}.betas=[{ADAMW['betas'][0]},{ADAMW['betas'][1]}]",
        f"{section}.eps={ADAMW['eps']}",
        f"{section}.weight_decay={ADAMW['weight_decay']}",
    ]


def run_args(run_dir: Path, steps: int) -> list[str]:
    """A short run of one worker, checkpointed at its end, without validation."""
    return [
        f"trainer.total_training_steps={steps}",
        f"trainer.save_freq={steps}",
        "trainer.n_workers_per_node=1",
        "trainer.logger=[jsonl]",
        "trainer.val_before_train=false",
        f"trainer.default_local_dir={run_dir}",
    ]


def run_and_export(command: str, args: list[str], run_dir: Path) -> Path:
    """Runs ``python -m hybridflow.trainer.commands.<command> args`` (its run directory ``run_dir``) and exports its
    last checkpoint's adapters to ``<run_dir>-adapter``."""
    process = subprocess.run(
        [sys.executable, "-m", f"hybridflow.trainer.commands.{command}", *args], capture_output=True
    )
    assert process.returncode == 0, process.stderr.decode()[-3000:]
    exported = run_dir.with_name(f"{run_dir.name}-adapter")
    export = [sys.executable, "-m", "hybridflow.cli", "export", str(run_dir), str(exported)]
    assert subprocess.run(export).returncode == 0
    return exported


def sft(tmp: Path, data: Path, name: str, lr: float, steps: int) -> Path:
    run_dir = tmp / name
    args = [
        f"data.train_files=[{data}]",
        f"model.path={MODEL}",
        f"model.lora.rank={RANK}",
        f"model.lora.alpha={ALPHA}",
        f"data.train_batch_size={BATCH}",
        "data.shuffle=false",
        "engine.fsdp.param_dtype=fp32",
        f"engine.grad_clip={CLIP}",
        *adamw_args("optim", lr),
        *run_args(run_dir, steps),
    ]
    run_and_export("sft", args, run_dir)
    return run_dir


def start_from(service, sdk_client, adapter_dir: Path, model_id: str):
    """A training client of the service whose adapters start as ``adapter_dir``'s (a trainer's export), filed as a
    saved state of this test's key."""
    saved = service.storage / model_id / "weights" / "start"
    saved.mkdir(parents=True)
    shutil.copy(adapter_dir / ADAPTER_FILE, saved / ADAPTER_FILE)
    meta = {
        "owner": owner_of(KEY),
        "path": f"tinker://{model_id}/weights/start",
        "base_model": MODEL,
        "rank": RANK,
        "parts": sorted({ATTN, MLP}),
        "scaling": ALPHA / RANK,
        "with_optimizer": False,
    }
    (saved / META_FILE).write_text(json.dumps(meta))
    return sdk_client.create_training_client_from_state(meta["path"]).result()


def metric_by_step(run_dir: Path, key: str) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in sorted(records, key=lambda r: r["step"]) if key in r]


def assert_same_adapters(service, model, exported: Path) -> None:
    path = model.save_weights_for_sampler("after").result().path
    model_id, kind, name = path.removeprefix("tinker://").split("/")
    got = load_file(str(service.storage / model_id / kind / name / ADAPTER_FILE))
    want = load_file(str(exported / ADAPTER_FILE))
    assert sorted(got) == sorted(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0)
    assert any(float(want[key].abs().max()) > 1e-3 for key in want if "lora_B" in key)  # they trained


def batches(data: Path) -> list[list[types.Datum]]:
    config = load_sft_config([f"data.train_files=[{data}]"]).data
    dataset = SFTDataset([str(data)], load_tokenizer(resolve_model_path(MODEL)), config)
    out = []
    for step in range(STEPS):
        rows = [dataset[i] for i in range(step * BATCH, (step + 1) * BATCH)]
        datums = [
            types.Datum(
                model_input=types.ModelInput.from_ints(inputs),
                loss_fn_inputs={"target_tokens": np.asarray(targets, dtype=np.int64), "weights": weights},
            )
            for inputs, targets, weights in token_mean_batch(rows)
        ]
        out.append(datums)
    return out


def test_sft_through_the_service_equals_hybridflow_sft(service, clients, tmp_path):
    data = write_rows(conversations(BATCH * STEPS), tmp_path / "train.jsonl")
    sft(tmp_path, data, "init", lr=0.0, steps=1)  # lr 0: the checkpoint holds the trainer's initial adapters
    trained = sft(tmp_path, data, "trained", lr=LR, steps=STEPS)
    model = start_from(service, clients(), tmp_path / "init-adapter", "sftinit:train:0")
    adam = types.AdamParams(learning_rate=LR, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, grad_clip_norm=CLIP)
    losses = []
    for datums in batches(data):
        losses.append(model.forward_backward(datums, "cross_entropy").result().metrics["loss:sum"])
        model.optim_step(adam).result()
    assert losses == pytest.approx(metric_by_step(trained, "sft/loss"), rel=1e-5)
    assert_same_adapters(service, model, tmp_path / "trained-adapter")


VOWELS_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    text = solution_str.replace(" ", "")
    return sum(c in "aeiou" for c in text) / max(1, len(text))
"""
PROMPTS, SAMPLES, RL_STEPS = 2, 4, 2


def grpo(tmp: Path, name: str, lr: float, steps: int) -> Path:
    """A GRPO run on tiny-llama rewarded for vowels (their share of the response's characters: it varies in every
    group), each step two mini-batches of one prompt's samples."""
    write_task("arithmetic", tmp / "prompts", train=PROMPTS * RL_STEPS, test=1, seed=0)
    reward = tmp / "vowels.py"
    reward.write_text(VOWELS_REWARD)
    run_dir = tmp / name
    args = [
        f"data.train_files=[{tmp / 'prompts' / 'train.parquet'}]",
        f"data.train_batch_size={PROMPTS}",
        f"actor_rollout_ref.model.path={MODEL}",
        f"actor_rollout_ref.model.lora.rank={RANK}",
        f"actor_rollout_ref.model.lora.alpha={ALPHA}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",  # two updates a step: the second one's ratios are not 1
        "actor_rollout_ref.actor.shuffle=false",
        f"actor_rollout_ref.rollout.n={SAMPLES}",
        "actor_rollout_ref.rollout.response_length=8",
        "actor_rollout_ref.actor.fsdp.param_dtype=fp32",
        "actor_rollout_ref.rollout.dtype=fp32",
        f"actor_rollout_ref.actor.grad_clip={CLIP}",
        *adamw_args("actor_rollout_ref.actor.optim", lr),
        f"custom_reward_function.path={reward}",
        *run_args(run_dir, steps),
        f"trainer.rollout_data_dir={run_dir}-rollouts",
    ]
    run_and_export("train", args, run_dir)
    return run_dir


def importance_sampling_datums(records: list[dict]) -> list[types.Datum]:
    """A step's samples as next-token datums: a response token's sampler log-prob is the trainer's old log-prob,
    its advantage the trainer's over the batch's response tokens (the token mean); the prompt's targets weigh 0."""
    trained = sum(sum(r["response_mask"]) for r in records)
    datums = []
    for r in records:
        tokens, first = r["prompt_ids"] + r["response_ids"], len(r["prompt_ids"]) - 1  # first: predicts response[0]
        logprobs, advantages = np.zeros(len(tokens) - 1, np.float32), np.zeros(len(tokens) - 1, np.float32)
        logprobs[first:] = r["old_log_probs"]
        advantages[first:] = np.asarray(r["advantages"], np.float32) * np.asarray(r["response_mask"]) / trained
        inputs = {"target_tokens": np.asarray(tokens[1:]), "logprobs": logprobs, "advantages": advantages}
        datums.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs))
    return datums


def test_importance_sampling_through_the_service_equals_hybridflow_grpo(service, clients, tmp_path):
    grpo(tmp_path, "init", lr=0.0, steps=1)
    trained = grpo(tmp_path, "trained", lr=LR, steps=RL_STEPS)
    assert metric_by_step(trained, "actor/pg_clipfrac") == [0.0] * RL_STEPS  # the PPO loss was the unclipped one
    model = start_from(service, clients(), tmp_path / "init-adapter", "rlinit:train:0")
    adam = types.AdamParams(learning_rate=LR, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, grad_clip_norm=CLIP)
    losses, grad_norms = [], []
    for step in range(1, RL_STEPS + 1):
        records = read_rollout_data(f"{trained}-rollouts", step)
        assert len(records) == PROMPTS * SAMPLES and len({r["uid"] for r in records}) == PROMPTS
        for start in range(0, len(records), SAMPLES):  # every mini-batch trains: its group's rewards differ
            assert any(abs(a) > 0 for r in records[start : start + SAMPLES] for a in r["advantages"])
        step_losses, step_norms = [], []
        for start in range(0, len(records), SAMPLES):  # the trainer's mini-batches: its rows in order, unshuffled
            mini_batch = records[start : start + SAMPLES]
            result = model.forward_backward(importance_sampling_datums(mini_batch), "importance_sampling").result()
            step_losses.append(result.metrics["loss:sum"])
            if start == 0:  # before this step's first update the service's log-probs are the trainer's old ones
                for r, output in zip(mini_batch, result.loss_fn_outputs):
                    served = output["logprobs"].to_numpy()[len(r["prompt_ids"]) - 1 :]
                    np.testing.assert_allclose(served, r["old_log_probs"], atol=1e-5, rtol=0)
            step_norms.append(model.optim_step(adam).result().metrics["grad_norm:mean"])
        assert abs(step_losses[1]) > 1e-5  # the second mini-batch's ratios are not 1: the importance weights count
        losses.append(sum(step_losses) / len(step_losses))  # the trainer's step metrics: means over mini-batches
        grad_norms.append(sum(step_norms) / len(step_norms))
    assert losses == pytest.approx(metric_by_step(trained, "actor/pg_loss"), rel=1e-4, abs=1e-7)
    assert grad_norms == pytest.approx(metric_by_step(trained, "actor/grad_norm"), rel=1e-5)
    assert_same_adapters(service, model, tmp_path / "trained-adapter")
