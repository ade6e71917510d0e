"""A checkpoint saved by 2 ranks loads on 1 rank (resharding), resumes the optimizer, and exports to HF."""

import torch
from transformers import AutoModelForCausalLM

from hybridflow.batch_keys import OLD_LOG_PROBS
from hybridflow.controller import RayResourcePool, RayWorkerGroup
from hybridflow.models import load_causal_lm
from hybridflow.trainer.commands.export import export_checkpoint


def spawn(world_size: int, config, actor_worker):
    pool = RayResourcePool([world_size])
    return pool, RayWorkerGroup(pool, actor_worker(config, world_size))


def update(group, batch):
    data = batch.select(deepcopy=True)
    data.batch[OLD_LOG_PROBS] = group.compute_log_prob(data).batch[OLD_LOG_PROBS]
    group.update_actor(data)


def test_save_on_2_ranks_resume_on_1_and_export(
    local_ray, tiny_path, rollout_batch, actor_config_factory, actor_worker_factory, tmp_path
):
    config = actor_config_factory(tiny_path, 1e-2, "actor_rollout_ref.actor.optim.eps=1e-8")
    pool, two = spawn(2, config, actor_worker_factory)
    update(two, rollout_batch)
    two.save_checkpoint(str(tmp_path))
    saved = two.full_state_dict()[0]
    update(two, rollout_batch)  # a second step: depends on the Adam moments saved above
    after_second_step = two.full_state_dict()[0]
    pool.release()

    pool, one = spawn(1, config, actor_worker_factory)
    one.load_checkpoint(str(tmp_path))
    loaded = one.full_state_dict()[0]
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name
    update(one, rollout_batch)
    resumed_second_step = one.full_state_dict()[0]
    pool.release()
    for name, tensor in after_second_step.items():
        assert torch.allclose(resumed_second_step[name], tensor, rtol=1e-4, atol=1e-6), name

    exported = export_checkpoint(tmp_path, tmp_path / "hf")
    assert (exported / "model.safetensors").is_file() and (exported / "tokenizer.json").is_file()
    hf_model = AutoModelForCausalLM.from_pretrained(exported).eval()
    trained = load_causal_lm(tiny_path).eval()
    trained.load_state_dict(saved, strict=False)
    ids = rollout_batch.batch["input_ids"]
    with torch.no_grad():
        assert torch.equal(hf_model(input_ids=ids).logits, trained(input_ids=ids).logits)
