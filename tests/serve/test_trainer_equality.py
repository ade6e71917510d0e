"""A short SFT run through the service equals the same steps through hybridflow's own trainer (``hybridflow sft``,
LoRA, fp32, one worker each): the same loss at every step (relative 1e-5) and the same adapters at the end
(absolute 1e-5).

The two must start from the same adapters: the trainer's initial ones (its run with lr 0, exported) are filed
under the service's storage as a saved state of this test's key, and the service's model starts from that path.
The service's datums are the trainer's batches (unshuffled), weighted by 1 / (trained tokens of the batch), so
that the API's summed loss is the trainer's token mean; AdamW, its settings and the gradient clip are the
trainer's."""

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
from hybridflow.data.tasks.arithmetic import make_rows
from hybridflow.data.token_rows import token_mean_batch
from hybridflow.engine.adapter_slots import ADAPTER_FILE, ATTN, MLP
from hybridflow.models import load_tokenizer, resolve_model_path
from hybridflow.serve.storage import META_FILE, owner_of
from hybridflow.trainer.setup.sft_config import load_sft_config

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

RANK, ALPHA, LR, BATCH, STEPS = 4, 8.0, 2e-3, 4, 3
ADAMW = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
CLIP = 1.0


def conversations(count: int) -> list[dict]:
    rows = make_rows(count, split="train", seed=3)
    answer = [{"role": "assistant", "content": r["reward_model"]["ground_truth"]} for r in rows]
    return [{"messages": [*r["prompt"], a]} for r, a in zip(rows, answer)]


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
        f"optim.lr={lr}",
        f"optim.betas=[{ADAMW['betas'][0]},{ADAMW['betas'][1]}]",
        f"optim.eps={ADAMW['eps']}",
        f"optim.weight_decay={ADAMW['weight_decay']}",
        f"trainer.total_training_steps={steps}",
        f"trainer.save_freq={steps}",
        "trainer.n_workers_per_node=1",
        "trainer.logger=[jsonl]",
        "trainer.val_before_train=false",
        f"trainer.default_local_dir={run_dir}",
    ]
    command = [sys.executable, "-m", "hybridflow.trainer.commands.sft", *args]
    assert subprocess.run(command, capture_output=True).returncode == 0
    exported = tmp / f"{name}-adapter"
    assert (
        subprocess.run([sys.executable, "-m", "hybridflow.cli", "export", str(run_dir), str(exported)]).returncode == 0
    )
    return run_dir


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
    model_id = "trainerinit:train:0"
    saved = service.storage / model_id / "weights" / "start"
    saved.mkdir(parents=True)
    shutil.copy(tmp_path / "init-adapter" / ADAPTER_FILE, saved / ADAPTER_FILE)
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
    sc = clients()
    model = sc.create_training_client_from_state(meta["path"]).result()
    adam = types.AdamParams(learning_rate=LR, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, grad_clip_norm=CLIP)
    losses = []
    for datums in batches(data):
        losses.append(model.forward_backward(datums, "cross_entropy").result().metrics["loss:sum"])
        model.optim_step(adam).result()
    records = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    expected = [r["sft/loss"] for r in sorted(records, key=lambda r: r["step"]) if "sft/loss" in r]
    assert losses == pytest.approx(expected, rel=1e-5)
    path = model.save_weights_for_sampler("after").result().path
    model_id, kind, name = path.removeprefix("tinker://").split("/")
    got = load_file(str(service.storage / model_id / kind / name / ADAPTER_FILE))
    want = load_file(str(tmp_path / "trained-adapter" / ADAPTER_FILE))
    assert sorted(got) == sorted(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0)
    assert any(float(want[key].abs().max()) > 1e-3 for key in want if "lora_B" in key)  # they trained
