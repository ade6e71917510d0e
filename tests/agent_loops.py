"""An agent loop for multi-turn tests, as the text of a file a run loads (multi_turn.default_agent=FILE:NAME)."""

# The tiny random model never writes a tool call, so this loop makes one for it after its first turn (through
# the same per-trajectory tools the built-in loop uses), appends the answer with the chat template's tokens, and
# lets the model answer in a second turn.
CALCULATE_THEN_ANSWER = """
from hybridflow.rollout.agent import AgentLoop, RequestState
from hybridflow.rollout.agent.parsers import ToolCall


class CalculateThenAnswer(AgentLoop):
    async def run(self, trajectory, context):
        trajectory.move_to(RequestState.GENERATING)
        turn = await context.engine.generate(trajectory.request, trajectory.prompt, 4)
        trajectory.add_generated(turn)
        trajectory.move_to(RequestState.RUNNING_TOOLS)
        answer = await context.tools.call(ToolCall("calculator", {"expression": "6 * 7"}))
        trajectory.tool_calls += 1
        inserted = context.chat.tool_response_ids([answer.text])
        trajectory.add_inserted(inserted)
        trajectory.move_to(RequestState.GENERATING)
        trajectory.add_generated(await context.engine.generate(trajectory.request, inserted, 6))
        trajectory.finish("no_tool_call")
"""
