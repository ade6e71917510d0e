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
advantage) is zero has a zero loss gradient. So the head is given the hidden states and returns the log-probs itself
(``datum_log_probs``): with autograd on the trained positions only, as in ``hybridflow sft``, and a chunk of rows at
a time without it on the rest. No (positions x vocabulary) logits are kept, written or copied whole: with a 49,152-word
vocabulary those passes over memory cost more than the head's matmul.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from hybridflow.algorithms.datum_losses import TARGET_TOKENS, Datum, DatumOutput
from hybridflow.algorithms.entropy import log_probs_from_logits
from hybridflow.algorithms.objectives import DatumObjective, ForwardOutputs
from hybridflow.batch_keys import ATTENTION_MASK, INPUT_IDS, POSITION_IDS, RESPONSE_MASK, RESPONSES
from hybridflow.engine.dynamic_batch import micro_batch_groups, split_by_groups
from hybridflow.engine.forward import response_log_probs, response_outputs
from hybridflow.engine.packing import accepts_logits_to_keep
from hybridflow.protocol import DataProto

FILLER = 0  # the token after a datum's last one: an input nothing reads
# models whose forward returns what their output head returns (False: it changes it, so the plain pass runs)
_HEAD_GIVES_LOG_PROBS: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
HEAD_CHUNK_BYTES = 16 * 2**20  # logits of the positions without autograd are made this much at a time


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


def datum_log_probs(model: nn.Module, micro: DataProto, trained: torch.Tensor) -> torch.Tensor:
    """(B, R) float32: log p(target) at each datum position of ``micro`` (0 on padding), with autograd at the packed
    positions ``trained`` (M,) only (row-major over the response mask).

    The output head gets the hidden states of the M positions and gives their log-probs itself
    (``_head_log_probs``), so no (M, V) logits are kept: the positions without a gradient run through it in chunks
    without autograd. A model whose forward changes the head's output (a logit scale, a soft cap) or that runs the
    head on every packed token gives the plain pass instead: the logits, the log-probs from them (``head_gradient_at``
    leaving the untrained positions out of autograd).
    """
    mask = micro.batch[RESPONSE_MASK].bool()
    if _HEAD_GIVES_LOG_PROBS.get(model, True) and accepts_logits_to_keep(model):
        values = _through_head(model, micro, micro.batch[RESPONSES][mask], trained)
        if values is not None:
            return torch.zeros(mask.shape, dtype=values.dtype, device=values.device).masked_scatter(mask, values)
        _HEAD_GIVES_LOG_PROBS[model] = False
    with head_gradient_at(model, trained):
        return response_log_probs(model, micro, remove_padding=True)[0]


def _through_head(
    model: nn.Module, micro: DataProto, labels: torch.Tensor, trained: torch.Tensor
) -> torch.Tensor | None:
    """The (M,) log-probs the output head gives when it computes them itself; None where the model's output is not
    the head's (its forward transformed it, or the head saw other positions than the M)."""
    head = model.get_output_embeddings()
    run, own = head.forward, head.__dict__.get("forward")
    given: list[tuple[torch.Tensor, torch.Tensor]] = []

    def log_probs_forward(hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[:2] != (1, labels.numel()):
            return run(hidden)
        rows = max(1, HEAD_CHUNK_BYTES // (head.weight.shape[0] * 4))  # float32 logits of the vocabulary
        values = _head_log_probs(run, hidden[0], labels, trained, rows)
        given.append((values, values.detach().clone()))
        return values.view(1, -1, 1)

    head.forward = log_probs_forward
    try:
        logits = response_outputs(model, micro, remove_padding=True).logits
    finally:
        if own is None:
            del head.forward  # the class's forward again
        else:
            head.forward = own
    if not given:
        return None
    values, copy = given[0]
    same = logits.data_ptr() == values.data_ptr() and logits.numel() == values.numel()
    return values if same and torch.equal(logits.detach().reshape(-1), copy) else None


def _head_log_probs(
    run: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    labels: torch.Tensor,
    trained: torch.Tensor,
    rows: int,
) -> torch.Tensor:
    """log softmax(head(hidden))[label] for each of the M rows of ``hidden`` (M, H), float32: with autograd where
    ``trained``, without it elsewhere, ``rows`` rows at a time (the logits never whole)."""
    values = torch.empty(labels.shape, dtype=torch.float32, device=hidden.device)
    frozen = (~trained).nonzero().flatten()
    if frozen.numel():
        with torch.no_grad():
            for chunk in frozen.split(rows):
                logits = run(hidden[None, chunk])[0]
                values[chunk] = log_probs_from_logits(logits, labels[chunk]).float()
    if not bool(trained.any()):
        return values
    live = log_probs_from_logits(run(hidden[None, trained])[0], labels[trained]).float()
    return values.masked_scatter(trained, live)


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
    lengths = [len(d.tokens) + 1 for d in datums]
    groups = [sorted(group) for group in micro_batch_groups(lengths, len(datums), max_tokens)]
    for group, micro in zip(groups, split_by_groups(rows, groups)):
        mask = micro.batch[RESPONSE_MASK].bool()
        # the packed positions (row-major) whose loss has a gradient
        trained = (micro.batch[objective.trains][mask] != 0) & backward
        with torch.set_grad_enabled(backward):
            logprobs = datum_log_probs(model, micro, trained)
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
