"""``hybridflow upcycle MODEL OUT [--experts E] [--top-k K] [--seed S]``: a dense Llama-family model (a built-in
name or a Hugging Face directory) as a Mixtral-architecture mixture of experts that answers exactly as it does
(models/upcycle.py), written to OUT as a Hugging Face directory that ``actor_rollout_ref.model.path`` (or any
model key) reads.

    hybridflow upcycle smollm2-135m-instruct runs/smollm2-moe --experts 4 --top-k 2
"""

from __future__ import annotations

from pathlib import Path

from hybridflow.validation import ArgumentParser, UserError


def upcycle_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="hybridflow upcycle", description=__doc__)
    parser.add_argument("model", help="a dense Llama-family model: built-in name or local Hugging Face directory")
    parser.add_argument("out", help="the directory to write (must not exist, or be empty)")
    parser.add_argument("--experts", type=int, default=4, help="experts per MoE layer, each a copy of the MLP")
    parser.add_argument("--top-k", type=int, default=2, help="experts each token is routed to")
    parser.add_argument("--seed", type=int, default=0, help="seed of the routers' random initialisation")
    return parser


def main(argv: list[str]) -> int:
    from hybridflow.models import resolve_model_path
    from hybridflow.models.upcycle import upcycle

    args = upcycle_parser().parse_args(argv)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"upcycle: {out} exists and is not empty; give a new directory")
    if not 1 <= args.top_k <= args.experts:
        raise UserError(f"upcycle: --top-k {args.top_k} must be 1 to --experts {args.experts}")
    try:
        written = upcycle(resolve_model_path(args.model), out, experts=args.experts, top_k=args.top_k, seed=args.seed)
    except ValueError as error:
        raise UserError(f"upcycle: {args.model}: {error}") from None
    print(f"upcycled {args.model} into {args.experts} experts ({args.top_k} per token) at {written}")
    return 0
