"""A GRPO run that trains LoRA adapters through real Ray worker groups on tiny-llama: it learns, with the KL
term's reference computed by the actor with its adapters off (no reference worker); its checkpoint holds the
adapters only; the export is peft's adapter directory, and the merged export is the adapted model.

The model is tiny-llama with its output head scaled up 10x: with the head frozen, the random tiny model's small
head lets the adapters move no token's probability much (logits shift by at most |head row| x |final hidden
state| ~ 1.3), so it could never learn to write digits; a pretrained model's head has the norm this gives."""

import json
import math

import pytest
import torch
from peft import PeftModel
from test_train_e2e import DIGITS_REWARD
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM

from hybridflow.cli import main as cli
from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.trainer.commands.train import run
from hybridflow.trainer.setup.config import load_config

pytestmark = pytest.mark.slow

STEPS = 10


# tiny OLMoE with adapters on every expert too (peft's target_parameters), its routes replayed in fp32 so that the
# rollout's log-probs must equal the trainer's: the engine serves each expert's own adapter after every sync
EXPERT_ADAPTERS = [
    "actor_rollout_ref.model.lora.target_parameters=[experts.gate_up_proj,experts.down_proj]",
    "actor_rollout_ref.actor.router_replay.mode=R3",
    "actor_rollout_ref.rollout.dtype=fp32",
    "actor_rollout_ref.actor.fsdp.param_dtype=fp32",
]


def sharp_tiny_model(directory, name: str = "tiny-llama"):
    model = load_causal_lm(name, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    model.save_pretrained(directory)
    load_tokenizer(name).save_pretrained(directory)
    return directory


@pytest.mark.parametrize(
    "model, extra",
    [
        ("tiny-llama", []),
        ("tiny-olmoe", EXPERT_ADAPTERS),
        # the experts split over the 2 ranks, each adding the adapters of those it holds
        ("tiny-olmoe", [*EXPERT_ADAPTERS, "actor_rollout_ref.actor.expert_model_parallel_size=2"]),
    ],
    ids=["dense", "experts", "experts-ep2"],
)
def test_lora_grpo_learns_checkpoints_its_adapters_and_exports_them(
    local_ray, arithmetic_files, tmp_path, capsys, model, extra
):
    model_dir = sharp_tiny_model(tmp_path / "model", model)
    reward_file = tmp_path / "digits.py"
    reward_file.write_text(DIGITS_REWARD)
    train, _ = arithmetic_files
    run_dir = tmp_path / "run"
    config = load_config(
        [
            f"data.train_files=[{train}]",
            "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.rollout.response_length=8",
            f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.model.lora.rank=8",
            "actor_rollout_ref.model.lora.alpha=16",
            "actor_rollout_ref.actor.optim.lr=5e-2",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.kl_loss_coef=0.001",
            f"trainer.total_training_steps={STEPS}",
            "trainer.total_epochs=2",
            f"trainer.save_freq={STEPS}",
            "trainer.logger=[jsonl]",
            f"trainer.default_local_dir={run_dir}",
            f"custom_reward_function.path={reward_file}",
            *extra,
        ]
    )
    run(config)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    scores = [r["critic/score/mean"] for r in records]
    assert len(scores) == STEPS
    first, last = sum(scores[:2]) / 2, sum(scores[-2:]) / 2
    assert first < 0.1 and last > first + 0.5, scores
    # the reference ran (on the actor: the run had no reference worker) and the policy moved away from it
    assert all(r["timing_s/ref"] > 0 for r in records)
    assert records[0]["actor/kl_loss"] == 0.0 and records[-1]["actor/kl_loss"] > 0.0  # adapters start at zero
    if extra:  # every sync gave the engine the trainer's policy, each expert's adapter included
        assert max(r["rollout/log_prob_diff_max"] for r in records) < 1e-4

    # the checkpoint holds the adapters (and their optimizer state), not the model
    checkpoint = run_dir / f"global_step_{STEPS}"
    metadata = FileSystemReader(str(checkpoint / "actor" / "dcp")).read_metadata()
    weights = [k for k in metadata.state_dict_metadata if k.startswith("model.")]
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights)
    base = load_causal_lm(str(model_dir), dtype=torch.float32)
    layers = base.config.num_hidden_layers
    adapted = 4 + 2 if extra else 7  # q, k, v, o and the two expert weights; or the 7 linear layers
    assert len(weights) == 2 * adapted * layers
    assert bool(extra) == any(".experts." in k for k in weights)
    saved = sum(math.prod(v.size) for v in metadata.state_dict_metadata.values() if hasattr(v, "size"))
    adapters = sum(math.prod(metadata.state_dict_metadata[k].size) for k in weights)
    assert saved == 3 * adapters + len(weights)  # the adapters, AdamW's two moments and step count of each
    assert saved < sum(p.numel() for p in base.parameters()) / 2

    # export: peft's adapter directory over the base model, and the merged model, are the same policy
    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    assert cli(["export", str(run_dir), str(adapter_dir)]) == 0
    assert cli(["export", str(run_dir), str(merged_dir), "--merged"]) == 0
    capsys.readouterr()
    config_file = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config_file["r"] == 8 and config_file["base_model_name_or_path"] == str(model_dir)
    adapted = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    plain = load_causal_lm(str(model_dir), dtype=torch.float32).eval()
    ids = torch.randint(3, base.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        from_adapters, from_merged, from_base = (m(input_ids=ids).logits for m in (adapted, merged, plain))
    torch.testing.assert_close(from_merged, from_adapters, rtol=1e-4, atol=1e-4)
    assert (from_adapters - from_base).abs().max() > 1e-2  # the adapters trained
