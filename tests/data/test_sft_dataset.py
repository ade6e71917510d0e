"""SFT samples: the loss mask covers exactly the assistant turns (through their end token), placed where the chat
template puts them at generation time; templates that re-render earlier turns start a new sample; bad rows and
templates are refused with the row named."""

import copy
import dataclasses

import pytest

from hybridflow.batch_keys import ATTENTION_MASK, INPUT_IDS, POSITION_IDS, RESPONSE_MASK, RESPONSES
from hybridflow.data import SFTDataset, SFTDatasetConfig
from hybridflow.data.chat_mask import ChatMaskError, conversation_samples
from hybridflow.data.io import write_rows
from hybridflow.data.sft_dataset import LOSS_MASK, PROMPT_IDS, RESPONSE_IDS
from hybridflow.validation import ConfigError, InputFileError

CONFIG = SFTDatasetConfig(
    messages_key="messages",
    prompt_key="prompt",
    response_key="response",
    tools_key="tools",
    max_length=512,
    overlong="error",
)
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "734 * 58"}}</tool_call>'
CONVERSATION = [
    {"role": "system", "content": "Use the calculator."},
    {"role": "user", "content": "What is 734 * 58?"},
    {"role": "assistant", "content": CALL},
    {"role": "tool", "content": "42572"},
    {"role": "assistant", "content": "The answer is 42572."},
    {"role": "user", "content": "Thanks!"},  # after the last assistant turn: nothing to learn, dropped
]
# Qwen3-style: the reasoning of an assistant turn is dropped once a later user turn exists
THINKING_TEMPLATE = (
    "{% set last_user = namespace(i=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set last_user.i = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% set content = m['content'] %}"
    "{% if m['role'] == 'assistant' and loop.index0 < last_user.i %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + content + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# renders structured tool calls as hermes text; the tiny model's own template ignores them
TOOL_CALLS_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + (m['content'] or '') }}"
    "{% for call in m.get('tool_calls') or [] %}"
    "{{ '<tool_call>{\"name\": \"' + call['function']['name'] + '\"}</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def dataset(tmp_path, tokenizer, rows, **changes) -> SFTDataset:
    path = tmp_path / "rows.jsonl"
    write_rows(rows, path)
    return SFTDataset(path, tokenizer, dataclasses.replace(CONFIG, **changes))


def with_template(tokenizer, template: str):
    other = copy.deepcopy(tokenizer)
    other.chat_template = template
    return other


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_the_mask_covers_exactly_the_assistant_turns_of_a_tool_calling_conversation(tmp_path, tiny_tokenizer):
    """Written out by hand: the tiny template is ChatML, the tool's answer and the turn headers untrained."""
    (row,) = dataset(tmp_path, tiny_tokenizer, [{"messages": CONVERSATION}]).rows
    pieces = [
        ("<|im_start|>system\nUse the calculator.<|im_end|>\n<|im_start|>user\nWhat is 734 * 58?<|im_end|>\n"
         "<|im_start|>assistant\n", 0),
        (CALL + "<|im_end|>", 1),
        ("\n<|im_start|>tool\n42572<|im_end|>\n<|im_start|>assistant\n", 0),
        ("The answer is 42572.<|im_end|>", 1),
    ]  # fmt: skip
    ids = [encode(tiny_tokenizer, text) for text, _ in pieces]
    assert row[PROMPT_IDS] == ids[0]
    assert row[RESPONSE_IDS] == ids[1] + ids[2] + ids[3]
    assert row[LOSS_MASK] == [1] * len(ids[1]) + [0] * len(ids[2]) + [1] * len(ids[3])
    trained = [t for t, m in zip(row[RESPONSE_IDS], row[LOSS_MASK], strict=True) if m]
    assert tiny_tokenizer.decode(trained) == CALL + "<|im_end|>The answer is 42572.<|im_end|>"


def test_a_template_that_re_renders_earlier_turns_trains_each_turn_in_the_context_it_was_written_in(
    tmp_path, tiny_tokenizer
):
    tokenizer = with_template(tiny_tokenizer, THINKING_TEMPLATE)
    messages = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "<think>2 and 3</think>5"},
        {"role": "user", "content": "times 4?"},
        {"role": "assistant", "content": "<think>5 times 4</think>20"},
    ]
    first, second = dataset(tmp_path, tokenizer, [{"messages": messages}]).rows

    def text(row, trained):
        ids = row[PROMPT_IDS] + row[RESPONSE_IDS]
        mask = [0] * len(row[PROMPT_IDS]) + row[LOSS_MASK]
        return tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m == trained])

    # the first turn with its reasoning, as the model wrote it
    assert text(first, 1) == "<think>2 and 3</think>5<|im_end|>"
    assert text(first, 0) == "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n"
    # the second turn in the context the template gives it: the first turn's reasoning gone, and not trained again
    assert text(second, 1) == "<think>5 times 4</think>20<|im_end|>"
    assert text(second, 0) == (
        "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n"
        "<|im_start|>user\ntimes 4?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_an_append_only_template_keeps_a_conversation_in_one_sample():
    def render(messages, add_generation_prompt):
        text = "".join(f"[{m['role']}]{m['content']}<end>" for m in messages)
        return text + ("[assistant]" if add_generation_prompt else "")

    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    (sample,) = conversation_samples(messages, render, ["<end>"])
    assert sample.segments == [
        ("[user]a<end>[assistant]", False),
        ("b<end>", True),
        ("[user]c<end>[assistant]", False),
        ("d<end>", True),
    ]


def test_structured_tool_calls_are_trained_where_the_template_writes_them(tmp_path, tiny_tokenizer):
    messages = [
        {"role": "user", "content": "What is 2 * 21?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "calculator"}}]},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "42"},
    ]
    tokenizer = with_template(tiny_tokenizer, TOOL_CALLS_TEMPLATE)
    (row,) = dataset(tmp_path, tokenizer, [{"messages": messages}]).rows
    trained = [t for t, m in zip(row[RESPONSE_IDS], row[LOSS_MASK], strict=True) if m]
    assert tokenizer.decode(trained) == '<tool_call>{"name": "calculator"}</tool_call><|im_end|>42<|im_end|>'
    # the tiny model's own template drops them: refused, rather than training an assistant turn without its call
    with pytest.raises(InputFileError, match=r"row 0: message 1: the chat template does not write the assistant's"):
        dataset(tmp_path, tiny_tokenizer, [{"messages": messages}])


def test_prompt_response_rows_train_the_answer_and_its_end_token(tmp_path, tiny_tokenizer):
    few_shot = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]
    rows = [
        {"prompt": [*few_shot, {"role": "user", "content": "2+2?"}], "response": "4"},
        {"prompt": "Q: 2+3? A:", "response": " 5"},
    ]
    chat, text = dataset(tmp_path, tiny_tokenizer, rows).rows
    assert chat[PROMPT_IDS] == encode(  # the example's answer is part of the prompt, not trained
        tiny_tokenizer,
        "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n",
    )
    assert chat[RESPONSE_IDS] == encode(tiny_tokenizer, "4<|im_end|>")
    assert text[PROMPT_IDS] == encode(tiny_tokenizer, "Q: 2+3? A:")
    assert text[RESPONSE_IDS] == encode(tiny_tokenizer, " 5<|im_end|>")
    assert all(chat[LOSS_MASK]) and all(text[LOSS_MASK])


def test_collate_lays_samples_out_as_an_rl_step_left_padded_prompts_right_padded_responses(tmp_path, tiny_tokenizer):
    data = dataset(tmp_path, tiny_tokenizer, [{"messages": CONVERSATION}, {"prompt": "Q: 1+1? A:", "response": " 2"}])
    batch = data.collate(data.rows).batch
    rows = data.rows
    prompt_width = max(len(r[PROMPT_IDS]) for r in rows)
    response_width = max(len(r[RESPONSE_IDS]) for r in rows)
    assert batch[INPUT_IDS].shape == (2, prompt_width + response_width)
    pad = tiny_tokenizer.pad_token_id
    for i, row in enumerate(rows):
        prompt, response = row[PROMPT_IDS], row[RESPONSE_IDS]
        left = prompt_width - len(prompt)
        assert batch[INPUT_IDS][i].tolist() == [pad] * left + prompt + response + [pad] * (
            response_width - len(response)
        )
        assert batch[ATTENTION_MASK][i].tolist() == [0] * left + [1] * (len(prompt) + len(response)) + [0] * (
            response_width - len(response)
        )
        assert batch[POSITION_IDS][i, left:].tolist()[: len(prompt) + len(response)] == list(
            range(len(prompt) + len(response))
        )
        assert batch[RESPONSES][i].tolist() == batch[INPUT_IDS][i, prompt_width:].tolist()
        assert batch[RESPONSE_MASK][i].tolist() == row[LOSS_MASK] + [0] * (response_width - len(response))


def test_overlong_samples_stop_the_run_or_are_dropped_or_cut(tmp_path, tiny_tokenizer):
    rows = [{"prompt": "Q: 1+1? A:", "response": " 2"}, {"prompt": "Q: 1+1? A:", "response": " 2" * 40}]
    with pytest.raises(ConfigError, match=r"data.max_length.*row 1 .* longer than 20"):
        dataset(tmp_path, tiny_tokenizer, rows, max_length=20)
    assert len(dataset(tmp_path, tiny_tokenizer, rows, max_length=20, overlong="drop")) == 1
    cut = dataset(tmp_path, tiny_tokenizer, rows, max_length=20, overlong="truncate").rows[1]
    assert len(cut[PROMPT_IDS] + cut[RESPONSE_IDS]) == 20


@pytest.mark.parametrize(
    ("rows", "problem"),
    [
        ([{"text": "hello"}], r"row 0: neither a 'messages' column nor 'prompt' and 'response'"),
        ([{"messages": "hello"}], r"row 0: column 'messages' is not a list of chat messages"),
        (
            [{"messages": [{"role": "assistant", "content": "hi"}]}],
            r"row 0: message 0 is an assistant message",
        ),
        ([{"messages": [{"role": "user", "content": "hi"}]}], r"row 0: the conversation has no assistant message"),
    ],
)
def test_rows_that_are_not_conversations_are_refused_naming_the_row(tmp_path, tiny_tokenizer, rows, problem):
    with pytest.raises(InputFileError, match=problem):
        dataset(tmp_path, tiny_tokenizer, rows)


def test_a_template_without_an_end_token_or_a_generation_prompt_that_is_not_a_prefix_is_refused():
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]

    def no_end(messages, add_generation_prompt):
        return "".join(f"[{m['role']}]{m['content']}" for m in messages) + (
            "[assistant]" if add_generation_prompt else ""
        )

    with pytest.raises(ChatMaskError, match="without an end token"):
        conversation_samples(messages, no_end, ["<end>"])

    def other_prompt(messages, add_generation_prompt):
        return "".join(f"[{m['role']}]{m['content']}<end>" for m in messages) + (
            "[bot]" if add_generation_prompt else ""
        )

    with pytest.raises(ChatMaskError, match="does not start with its text for the conversation before it"):
        conversation_samples(messages, other_prompt, ["<end>"])


def test_calculator_gold_trajectories_are_the_tokens_the_tool_agent_loop_would_produce(tmp_path, tiny_tokenizer):
    """The prompt as RL's dataset tokenises it (the worked example's assistant turns untrained), the call and the
    answer trained, and between them exactly the ids the agent loop inserts for the tool's message."""
    from hybridflow.data import RLHFDataset
    from hybridflow.data.tasks import write_task
    from hybridflow.rollout.agent.chat import ChatFormat
    from hybridflow.trainer.setup.config import default_config

    paths = write_task("calculator", tmp_path, train=3, test=1, seed=0, gold=True)
    gold = SFTDataset(paths["train"], tiny_tokenizer, CONFIG)
    data = dataclasses.replace(default_config().data, max_prompt_length=512)
    prompts = RLHFDataset(paths["train"], tiny_tokenizer, data)
    tool_format = ChatFormat(tiny_tokenizer, [tiny_tokenizer.eos_token_id])
    for row, prompt in zip(gold.rows, prompts.rows, strict=True):
        assert row[PROMPT_IDS] == prompt[INPUT_IDS]
        expression = prompt["extra_info"]["expression"]
        result = str(eval(expression))  # the task's expressions are products and sums of integers
        call = encode(tiny_tokenizer, CALL.replace("734 * 58", expression) + "<|im_end|>")
        inserted = tool_format.tool_response_ids([result])
        answer = encode(tiny_tokenizer, result + "<|im_end|>")
        assert row[RESPONSE_IDS] == call + inserted + answer
        assert row[LOSS_MASK] == [1] * len(call) + [0] * len(inserted) + [1] * len(answer)


def test_gold_trajectories_of_a_task_without_them_are_refused(tmp_path):
    from hybridflow.data.tasks import write_task

    with pytest.raises(
        ValueError, match="task 'arithmetic' has no gold trajectories; tasks that have: \\['calculator'\\]"
    ):
        write_task("arithmetic", tmp_path, train=2, test=1, gold=True)
