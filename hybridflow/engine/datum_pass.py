"""Forward (and backward) passes over datums: token sequences with a target token at every position, through the
packed forward every training pass uses (engine/forward.py).

A datum is the Tinker API's unit (``algorithms/datum_losses.py``; its losses are objectives,
``algorithms/objectives/datum.py``): ``tokens`` (N,) and per-position inputs, among
them ``target_tokens`` (N,), the token each position is scored on (usually the next one, but any token). The pass
reads the log-probability of each target under the model, the loss per token, and with a backward pass adds the
summed loss's gradient to the parameters' gradients: calls accumulate until the optimizer step, as the API says.

Datums become rows of the RL step's layout (``datum_rows``): a one-token prompt (the datum's first token), then the
rest of its tokens and one filler token as the "response", whose N labels are the targets: the output at position i
(0 <= i < N) predicts response label i, which is ``target_tokens[i]``. The filler is an input nothing reads (causal
attention keeps it out of every earlier position). Micro-batches hold at most a budget of real tokens; packing runs
no padding, so the micro-batching changes no result beyond float rounding.

The API returns every position's log-prob, so the LM head runs on every position; but a position whose weight (or
advantage) is zero has a zero loss gradient, so in a backward pass the head runs with autograd on the trained
positions only and without it on the rest (``head_gradient_at``): the backward through the head, the largest
layer, costs what the trained tokens cost, as in ``hybridflow sft``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from hybridflow.algorithms.datum_losses import TARGET_TOKENS, Datum, DatumOutput
from hybridflow.algorithms.objectives import DatumObjective, ForwardOutputs
from hybridflow.batch_keys import ATTENTION_MASK, INPUT_IDS, POSITION_IDS, RESPONSE_MASK, RESPONSES
from hybridflow.engine.dynamic_batch import group_by_tokens, split_by_groups
from hybridflow.engine.forward import response_log_probs
from hybridflow.protocol import DataProto

FILLER = 0  # the token after a datum's last one: an input nothing reads


def datum_rows(datums: Sequence[Datum], names: Sequence[str], device: torch.device) -> DataProto:
    """The datums as rows of the RL layout (B, 1 + R), R the longest datum: see the module docstring. Besides the
    layout's columns, each loss input in ``names`` is a (B, R) float column, 0 on padding."""
    rows, longest = len(datums), max(len(d.tokens) for d in datums)
    input_ids = torch.full((rows, 1 + longest), FILLER, dtype=torch.long)
    attention_mask = torch.zeros(rows, 1 + longest, dtype=torch.long)
    targets = torch.zeros(rows, longest, dtype=torch.long)
    inputs = {name: torch.zeros(rows, longest, dtype=torch.float32) for name in names}
    for row, datum in enumerate(datums):
        n = len(datum.tokens)
        input_ids[row, :n] = torch.as_tensor(datum.tokens, dtype=torch.long)
        attention_mask[row, : n + 1] = 1  # the datum's tokens and the filler
        targets[row, :n] = torch.as_tensor(datum.inputs[TARGET_TOKENS], dtype=torch.long)
        for name in names:
            inputs[name][row, :n] = torch.as_tensor(datum.inputs[name], dtype=torch.float32)
    columns = {
        INPUT_IDS: input_ids,
        ATTENTION_MASK: attention_mask,
        POSITION_IDS: (attention_mask.cumsum(dim=-1) - 1).clamp(min=0),
        RESPONSES: targets,
        RESPONSE_MASK: attention_mask[:, 1:].clone(),
        **inputs,
    }
    return DataProto.from_dict({key: value.to(device) for key, value in columns.items()})


@contextlib.contextmanager
def head_gradient_at(model: nn.Module, trained: torch.Tensor) -> Iterator[None]:
    """Within it, the model's output head (a row-wise map of hidden states (1, M, H), M = ``trained``'s length)
    records autograd at the positions ``trained`` only: the others' outputs are computed without it, and so carry
    no gradient. For a pass whose loss gradient is zero at those positions: the gradients are unchanged."""
    head = model.get_output_embeddings()
    if bool(trained.all()) or not bool(trained.any()):  # nothing to leave out, or nothing to keep: the plain head
        yield
        return
    run, own = head.forward, head.__dict__.get("forward")
    order = torch.cat([trained.nonzero().flatten(), (~trained).nonzero().flatten()])
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)

    def split_forward(hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[1] != trained.numel():  # a model that runs its head on every packed token
            return run(hidden)
        live = run(hidden[:, trained])
        with torch.no_grad():
            frozen = run(hidden[:, ~trained])
        return torch.cat([live, frozen], dim=1)[:, back]

    head.forward = split_forward
    try:
        yield
    finally:
        if own is None:
            del head.forward  # the class's forward again
        else:
            head.forward = own


def run_datums(
    model: nn.Module,
    datums: Sequence[Datum],
    objective: DatumObjective,
    *,
    backward: bool,
    max_tokens: int,
    device: torch.device,
    loss_scale: float = 1.0,
) -> tuple[list[DatumOutput], float]:
    """Each datum's log-probs and per-token loss, and the summed loss; with ``backward`` the gradient of
    ``loss_scale`` x the summed loss is added to the parameters' gradients (``loss_scale``: the data-parallel size,
    whose average FSDP takes). Micro-batches hold at most ``max_tokens`` real tokens (a longer datum runs alone)."""
    rows = datum_rows(datums, objective.inputs, device)
    outputs: list[DatumOutput | None] = [None] * len(datums)
    total = 0.0
    groups = [sorted(group) for group in group_by_tokens([len(d.tokens) + 1 for d in datums], max_tokens)]
    for group, micro in zip(groups, split_by_groups(rows, groups)):
        mask = micro.batch[RESPONSE_MASK]
        head = contextlib.nullcontext()
        if backward:  # the packed head positions (row-major) whose loss has a gradient
            head = head_gradient_at(model, micro.batch[objective.trains][mask.bool()] != 0)
        with torch.set_grad_enabled(backward), head:
            logprobs, _ = response_log_probs(model, micro, remove_padding=True)
            per_token = objective.per_token(ForwardOutputs(log_probs=logprobs), micro.batch)
            summed = per_token.sum()
            if backward:
                (summed * loss_scale).backward()
        total += float(summed.detach())
        logprobs, per_token = logprobs.detach().float().cpu(), per_token.detach().float().cpu()
        for row, index in enumerate(group):
            n = len(datums[index].tokens)
            outputs[index] = DatumOutput(logprobs[row, :n].numpy().copy(), per_token[row, :n].numpy().copy())
    return [o for o in outputs if o is not None], total
