"""Routing replay (models/routing.py): the rollout's recorded experts (R3), replayed in the training forward, give the
rollout's log-probs where the trainer's own router would choose other experts; replaying a model's own routes
changes nothing, values or gradients; the trainer's old-log-prob pass records them too (R2)."""

import asyncio
import copy
import dataclasses

import pytest
import torch

from hybridflow.batch_keys import RESPONSE_MASK, ROLLOUT_LOG_PROBS, ROUTED_EXPERTS
from hybridflow.engine.forward import batched_log_probs, response_log_probs
from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.models.routing import ROUTE_DTYPE, RouteReplay, renormalizes, replayed_choice, replaying_routes, routers
from hybridflow.protocol import DataProto
from hybridflow.rollout.agent import AgentLoop, AgentRollout, RequestState, register_agent_loop
from hybridflow.rollout.agent.loops import AGENT_LOOPS
from hybridflow.rollout.hf.rollout import HFRollout, generation_routes
from hybridflow.rollout.native import NativeRollout
from hybridflow.rollout.sampling import SamplingParams
from hybridflow.tools import ToolSet
from hybridflow.trainer.setup.config import default_config
from tests.rollout.agent.agent_helpers import multi_turn_config

FAMILIES = ["tiny-mixtral", "tiny-qwen3-moe", "tiny-olmoe"]
RECORDING = SamplingParams(
    do_sample=False, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=8, seed=0, record_routes=True
)


def prompts() -> DataProto:
    """Two left-padded prompts (the first with 2 pad columns)."""
    ids = torch.tensor([[0, 0, 5, 17, 33, 8], [11, 12, 13, 14, 15, 16]])
    mask = (torch.arange(6)[None] >= torch.tensor([[2], [0]])).long()
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(0)}
    )


NATIVE = default_config().actor_rollout_ref.rollout.native
ROLLOUTS = {"hf": HFRollout, "native": lambda model, tokenizer: NativeRollout(model, tokenizer, engine_config=NATIVE)}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    torch.manual_seed(0)
    return load_causal_lm(request.param, dtype=torch.float32).eval(), load_tokenizer(request.param)


def test_the_replayed_choice_of_the_routers_own_experts_is_its_output(family):
    model, _ = family
    hidden = torch.randn(7, model.config.hidden_size)
    for gate in routers(model):
        logits, weights, experts = gate(hidden)
        replayed, chosen = replayed_choice(logits, experts.to(ROUTE_DTYPE), renormalizes(gate), weights.dtype)
        assert torch.equal(chosen, experts) and torch.equal(replayed, weights)
        unknown = torch.full_like(experts, -1)  # nothing recorded: the router's own choice
        replayed, chosen = replayed_choice(logits, unknown, renormalizes(gate), weights.dtype)
        assert torch.equal(chosen, experts) and torch.equal(replayed, weights)


def test_generation_routes_by_hand():
    """Prompts (B=2, P=2) in one forward, then one token per step; the last token and padding have none."""
    layers, k = 1, 2
    prefill = torch.arange(8, dtype=ROUTE_DTYPE).view(4, layers, k)  # rows (0, p0) (0, p1) (1, p0) (1, p1)
    step = torch.tensor([[[10, 11]], [[12, 13]]], dtype=ROUTE_DTYPE)  # each row's first response token
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])  # row 0: a pad prompt column, a response of 2 tokens
    routes = generation_routes([prefill, step], mask, prompt_length=2)
    assert routes.shape == (2, 5, layers, k)
    assert routes[0, :, 0].tolist() == [[-1, -1], [2, 3], [10, 11], [-1, -1], [-1, -1]]
    assert routes[1, :, 0].tolist() == [[4, 5], [6, 7], [12, 13], [-1, -1], [-1, -1]]


@pytest.mark.parametrize("rollout", ROLLOUTS)
@pytest.mark.parametrize("packed", [True, False])
def test_replaying_the_models_own_routes_changes_nothing(family, packed, rollout):
    """The recorded routes line up with the training forward's tokens: replaying them gives the same log-probs and
    the same gradients, the router's included (its weights still come from its logits)."""
    model, tokenizer = family
    batch = ROLLOUTS[rollout](model, tokenizer).generate_sequences(prompts(), RECORDING)
    assert batch.batch[ROUTED_EXPERTS].shape[:2] == batch.batch["input_ids"].shape
    results, replay = [], RouteReplay()
    for replaying in (None, replay):
        model.zero_grad()
        log_probs, _ = response_log_probs(model, batch, remove_padding=packed, replay_routes=replaying)
        (log_probs * batch.batch[RESPONSE_MASK]).sum().backward()
        results.append((log_probs.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    assert (
        replay.replayed > 0 and replay.changed == 0 and replay.metrics("update") == {"router_replay/changed_update": 0}
    )
    (own, own_grads), (replayed, replayed_grads) = results
    torch.testing.assert_close(replayed, own, rtol=0, atol=1e-6)
    assert len(own_grads) == len(replayed_grads) and routers(model)[0].weight.grad is not None
    for a, b in zip(own_grads, replayed_grads):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def near_tie_pair(model, delta: float = 1e-6):
    """Two copies of ``model`` whose first MoE layer routes one prompt token (row 1, position 3) differently: its
    k-th and (k+1)-th experts tied but for +-delta (the router's row of the (k+1)-th moved along the token's hidden
    state). Everything else agrees to O(delta): the rollout's and the trainer's computations of one policy, where
    rounding flips a near tie."""
    gate = routers(model)[0]
    seen = {}
    handle = gate.register_forward_hook(lambda module, inputs, output: seen.update(hidden=inputs[0].detach()))
    with torch.no_grad():
        model(input_ids=prompts().batch["input_ids"][1:])
    handle.remove()
    hidden = seen["hidden"].reshape(-1, gate.weight.shape[1])[3]
    logits = gate.weight.detach() @ hidden
    order = logits.argsort(descending=True)
    kth, next_one = order[gate.top_k - 1], order[gate.top_k]

    def moved(sign: float):
        copied = copy.deepcopy(model)
        with torch.no_grad():
            routers(copied)[0].weight[next_one] += (
                (logits[kth] - logits[next_one] + sign * delta) * hidden / hidden.dot(hidden)
            )
        return copied

    return moved(+1.0), moved(-1.0), (int(kth), int(next_one))


@pytest.mark.parametrize("rollout", ROLLOUTS)
@pytest.mark.parametrize("packed", [True, False])
def test_replay_makes_training_give_the_rollouts_log_probs_where_routing_flips(family, packed, rollout):
    model, tokenizer = family
    rollout_model, trainer, (kth, next_one) = near_tie_pair(model)
    batch = ROLLOUTS[rollout](rollout_model, tokenizer).generate_sequences(prompts(), RECORDING)
    recorded = batch.batch[ROUTED_EXPERTS][1, 3, 0].tolist()
    assert next_one in recorded and kth not in recorded  # the rollout took the (k+1)-th expert ...
    mask = batch.batch[RESPONSE_MASK].bool()
    gaps, replay = {}, RouteReplay()
    for replaying in (None, replay):
        with torch.no_grad():
            log_probs, _ = response_log_probs(trainer, batch, remove_padding=packed, replay_routes=replaying)
        gaps[replaying is not None] = float((log_probs - batch.batch[ROLLOUT_LOG_PROBS])[mask].abs().max())
    assert 1 <= replay.changed < replay.replayed  # the flipped route, and any that follow from it
    assert gaps[True] < 1e-5, gaps  # ... and the trainer, replaying it, computes the rollout's log-probs
    assert gaps[False] > 100 * gaps[True] and gaps[False] > 1e-4, gaps  # its own routing does not


def test_routes_that_do_not_match_the_forward_are_refused():
    model = load_causal_lm("tiny-mixtral", dtype=torch.float32)
    layers = len(routers(model))
    with pytest.raises(ValueError, match=r"routes of shape \(3, 7, 2\) for a model with 2 MoE layers"):
        with replaying_routes(model, torch.zeros(3, 7, 2, dtype=ROUTE_DTYPE)):
            pass
    with pytest.raises(ValueError, match=r"MoE layer 0 routes \(4, 2\) \(tokens, k\) but \(3, 2\) were recorded"):
        with replaying_routes(model, torch.zeros(3, layers, 2, dtype=ROUTE_DTYPE)), torch.no_grad():
            model(input_ids=torch.tensor([[1, 2, 3, 4]]))


def test_the_native_engine_logs_every_fed_token_through_its_shared_prefix_groups_and_refills(family):
    """Prompts with a common prefix (computed once), each sampled 3 times (one prefill per prompt), in a cache of 4
    slots (requests wait and refill freed slots): every real token but each response's last has its experts, and they
    are the ones the trainer's forward chooses for that token."""
    model, tokenizer = family
    engine = dataclasses.replace(NATIVE, max_num_seqs=4, min_shared_prefix=2)
    rollout = NativeRollout(model, tokenizer, engine_config=engine)
    out = rollout.generate_sequences(shared_prefix_prompts(), dataclasses.replace(RECORDING, do_sample=True, seed=3))
    assert rollout.stats.shared_prefix_tokens == 4 and rollout.stats.prefill_calls > 2  # the prefix, then refills
    assert_every_fed_token_has_the_experts_it_went_through(model, out)


def shared_prefix_prompts() -> DataProto:
    """Three left-padded prompts with a common prefix, each 3 times."""
    common = [7, 8, 9, 10]
    rows = [common + [21, 22], common + [23], common + [24, 25, 26]]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows for _ in range(3)])
    mask = (ids != 0).long()
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(0)}
    )


def assert_every_fed_token_has_the_experts_it_went_through(model, out: DataProto) -> None:
    """Every real token of ``out``'s rows but each row's last (which no forward ran) has recorded experts, padding
    none, and they are the trainer's own choices: replaying them (padded: each row's every token) changes no route."""
    routes, real = out.batch[ROUTED_EXPERTS], out.batch["attention_mask"].bool()
    last = real.long().cumsum(1).argmax(1)  # each row's last real column: its last response token
    expected = real.clone()
    expected[torch.arange(len(real)), last] = False
    assert torch.equal((routes >= 0).all(-1).all(-1), expected) and not (routes[~real] >= 0).any()
    replay = RouteReplay()
    response_log_probs(model, out, replay_routes=replay)
    assert replay.replayed == int(expected.sum()) * len(routers(model)) and replay.changed == 0


INSERTED = [31, 32, 33, 34, 35]  # a "tool answer" between an agent loop's turns


class TwoTurns(AgentLoop):
    """Up to 3 generated tokens, then INSERTED, then the rest of the budget: the second turn's tokens are computed
    by ``extend`` after the parked first turn, and the first turn's last token with them."""

    async def run(self, trajectory, context):
        trajectory.move_to(RequestState.GENERATING)
        trajectory.add_generated(await context.engine.generate(trajectory.request, trajectory.prompt, 3))
        trajectory.move_to(RequestState.RUNNING_TOOLS)
        trajectory.add_inserted(INSERTED)
        trajectory.move_to(RequestState.GENERATING)
        second = await context.engine.generate(trajectory.request, INSERTED, context.remaining(trajectory))
        trajectory.add_generated(second)
        trajectory.finish("no_tool_call")


@pytest.fixture(scope="module")
def two_turns():
    if "two_turns_for_routes" not in AGENT_LOOPS:
        register_agent_loop("two_turns_for_routes", TwoTurns)
    return "two_turns_for_routes"


@pytest.mark.parametrize("ragged", [True, False])
def test_agent_loops_on_the_native_engine_log_every_fed_token_of_every_turn(family, two_turns, ragged):
    """Multi-turn conversations (a common prompt prefix computed once, 3 samples a prompt, 4 slots so that requests
    wait, an inserted answer between two turns; ragged: the packed extend and decode, else the padded ones): every
    real token of prompt, turns and insert but each row's last has its experts, and they are the ones the trainer's
    forward chooses for that token, so replaying them changes no route."""
    model, tokenizer = family
    engine = dataclasses.replace(NATIVE, max_num_seqs=4, min_shared_prefix=2, ragged_decode=ragged)
    config = multi_turn_config(default_agent=two_turns)
    rollout = AgentRollout(NativeRollout(model, tokenizer, engine_config=engine), tokenizer, config, ToolSet())
    recording = dataclasses.replace(RECORDING, do_sample=True, seed=3, max_new_tokens=12)
    out = rollout.generate_sequences(shared_prefix_prompts(), recording)
    responses = out.batch["responses"]
    inserted = torch.tensor(INSERTED)
    assert all(any(torch.equal(row[i : i + 5], inserted) for i in range(8)) for row in responses)  # two turns each
    assert_every_fed_token_has_the_experts_it_went_through(model, out)


def test_the_request_api_refuses_recording_without_experts():
    model, tokenizer = load_causal_lm("tiny-llama", dtype=torch.float32), load_tokenizer("tiny-llama")
    engine = NativeRollout(model, tokenizer, engine_config=NATIVE).request_engine()

    async def session():
        async with engine.serving(RECORDING, max_len=16, max_requests=1):
            pass

    with pytest.raises(ValueError, match="record_routes: NativeRequestEngine records no routes"):
        asyncio.run(session())


@pytest.mark.parametrize("packed", [True, False])
def test_the_trainers_old_log_prob_pass_records_every_tokens_experts_for_r2(family, packed):
    """R2: the old-log-prob pass (micro-batches of 2 rows, the 3 samples of a prompt sharing it when packed) records
    each real token's experts in the batch's layout, and the update replaying them changes nothing at the same
    weights (every route is the one it would choose)."""
    model, tokenizer = family
    rows = [[7, 8, 9, 21, 22], [7, 8, 23], [5, 6, 7, 8, 24, 25]]
    ids = torch.tensor([[0] * (6 - len(r)) + r for r in rows for _ in range(3)])
    mask = (ids != 0).long()
    prompts_ = DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(0)}
    )
    batch = HFRollout(model, tokenizer).generate_sequences(
        prompts_, dataclasses.replace(RECORDING, record_routes=False)
    )
    recorded: list[torch.Tensor] = []
    batched_log_probs(model, batch, 2, 1.0, False, remove_padding=packed, routes=recorded)
    (routes,) = recorded
    real = batch.batch["attention_mask"].bool()
    assert routes.shape == (*real.shape, len(routers(model)), 2) and routes.dtype == ROUTE_DTYPE
    assert torch.equal((routes >= 0).all(-1).all(-1), real)
    replay = RouteReplay()
    batch.batch[ROUTED_EXPERTS] = routes
    response_log_probs(model, batch, replay_routes=replay)  # padded: every row's every token
    assert replay.replayed == int(real.sum()) * len(routers(model)) and replay.changed == 0
