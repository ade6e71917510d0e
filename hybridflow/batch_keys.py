"""The names of the columns a step's batch carries between the driver and the workers: one place.

The values are the names users meet in metrics, checkpoints of batches and other frameworks
(``old_log_probs`` beside ``ref_log_prob`` beside ``entropys`` is verl's spelling, kept). Code
reads and writes columns through these constants, so a typo is an import error, not a KeyError
three stages later. Shapes: B rows, P prompt columns (left-padded), R response columns.
"""

# ---- tensors (DataProto.batch) ----------------------------------------------------------------
INPUT_IDS = "input_ids"  # (B, P) prompts; (B, P+R) after generation
ATTENTION_MASK = "attention_mask"  # same shape as input_ids; 1 on real tokens
POSITION_IDS = "position_ids"  # same shape as input_ids; counts real tokens from 0
PROMPTS = "prompts"  # (B, P) the prompt part of input_ids
RESPONSES = "responses"  # (B, R) generated tokens, padded after the first stop token
RESPONSE_MASK = "response_mask"  # (B, R) 1 on the response tokens losses train on (generated, stop token included)
GENERATED_MASK = "generated_mask"  # (B, R) 1 on generated tokens: response_mask as generation returned it
TRUNCATED = "truncated"  # (B,) bool: the response holds no stop token (cut at the length budget)
ROLLOUT_LOG_PROBS = "rollout_log_probs"  # (B, R) the generator's log-probs of the sampled tokens
# (B, P+R, L, k) mixture of experts: the k experts the generator routed each token to in each of L MoE layers (-1: not
# recorded), for routing replay (engine/router_replay.py)
ROUTED_EXPERTS = "routed_experts"
# ---- partial rollout (fully asynchronous training): a response generated across weight pushes
PREFIX_LENGTH = "prefix_length"  # (B,) response tokens generated before this call (it continues after them)
INTERRUPTED = "interrupted"  # (B,) bool: the call stopped before this response finished (a weight push)
TOKEN_VERSIONS = "token_versions"  # (B, R) the weights version (trainer step) that generated each response token
OLD_LOG_PROBS = "old_log_probs"  # (B, R) the trainer's log-probs before the update (PPO's π_old)
ENTROPYS = "entropys"  # (B, R) the policy's entropy at each response position
ROLLOUT_IS_WEIGHTS = "rollout_is_weights"  # (B, R) rollout-correction importance weights for the policy loss
REF_LOG_PROB = "ref_log_prob"  # (B, R) the reference policy's log-probs
TEACHER_LOG_PROB = "teacher_log_prob"  # (B, R) on-policy distillation: the teacher's log-probs of the sampled tokens
VALUES = "values"  # (B, R) the critic's values
TOKEN_LEVEL_SCORES = "token_level_scores"  # (B, R) reward scores (an outcome score on the last token)
TOKEN_LEVEL_REWARDS = "token_level_rewards"  # (B, R) scores after the KL penalty, when it is in the reward
REWARD_BASELINES = "reward_baselines"  # (B,) ReMax: the score of the prompt's greedy response
RM_SCORES = "rm_scores"  # (B, R) the reward model's scores
ADVANTAGES = "advantages"  # (B, R)
RETURNS = "returns"  # (B, R)

PROMPT_TENSORS = (INPUT_IDS, ATTENTION_MASK, POSITION_IDS)  # what generation reads

# ---- multi-turn rollout (rollout/agent): per row. The response holds generated and inserted tokens
# (tool output, template tokens): attention_mask is 1 on both, response_mask only on generated ones.
NUM_TURNS = "num_turns"  # (B,) assistant (generation) turns
TOOL_CALLS = "tool_calls"  # (B,) tool calls the model made (malformed ones included)
TOOL_ERRORS = "tool_errors"  # (B,) calls answered with an error
# ---- the agent endpoint (rollout/agent_server): per row, what its session did
AGENT_REQUESTS = "agent_requests"  # (B,) requests the sample's agent made
AGENT_BRANCHES = "agent_branches"  # (B,) conversations its session started (an edited history starts one)
AGENT_PARSE_FAILURES = "agent_parse_failures"  # (B,) turns whose tool-call markup did not parse
AGENT_SERVER_SECONDS = "agent_server_seconds"  # (B,) time in the endpoint's own code for its requests
AGENT_GENERATED_TOKENS = "agent_generated_tokens"  # (B,) tokens the model generated in the session, every branch
# A session whose requests started several branches is trained on each (rollout/agent_server/branch_rows.py): the
# rollout hands its other branches in AGENT_BRANCH_ROWS, the driver makes each a row of the session's group.
LAST_BRANCH = "last_branch"  # (B,) bool: the row of its session's last branch, the one its reward was given for

# ---- per-row objects (DataProto.non_tensor_batch); the dataset's file columns keep these names -
UID = "uid"  # group id shared by the n samples of one prompt
DATA_SOURCE = "data_source"  # names the reward scorer
REWARD_MODEL = "reward_model"  # {"ground_truth": ..., "style": "rule"}
EXTRA_INFO = "extra_info"  # any per-row dict the task keeps
RAW_PROMPT = "raw_prompt"  # the chat messages before templating
INDEX = "index"  # the row's index in its dataset
AGENT_NAME = "agent_name"  # the row's agent loop (rollout/agent; "": multi_turn.default_agent)
STOP_REASON = "stop_reason"  # multi-turn: why the row's conversation ended (rollout/agent/state.py), or "failed"
TURN_SCORES = "turn_scores"  # multi-turn: list per row, each assistant turn's tool-call rewards summed
TURN_ENDS = "turn_ends"  # multi-turn: list per row, the response index of each assistant turn's last token
TOOL_REWARDS = "tool_rewards"  # multi-turn: dict per row, tool name -> its reward for the whole trajectory
AGENT_BRANCH_ROWS = "agent_branch_rows"  # the endpoint's rollout: per row, its session's other branches as rows
SESSION = "session"  # per row of a branching batch: its session's id (a row and its other branches share it)
AGENT_FAILURE = "agent_failure"  # multi-turn: why the row's agent loop failed ("" if it did not)
AGENT_REWARD = "agent_reward"  # agent endpoint: the reward the row's agent returned (NaN if it failed)
AGENT_METRICS = "agent_metrics"  # agent endpoint: the other numbers the row's agent returned {name: float}
FINAL_RESPONSE = "final_response"  # multi-turn: the last assistant turn's text, added to extra_info for scorers
NLL_SUM = "nll_sum"  # SFT evaluation: (B,) a row's summed negative log-likelihood over its trained tokens
LOSS_TOKENS = "loss_tokens"  # SFT evaluation: (B,) a row's trained tokens
ANSWER_LOG_PROB = "answer_log_prob"  # preference evaluation: (B,) a row's answer log-prob under the trained model
REF_ANSWER_LOG_PROB = "ref_answer_log_prob"  # preference evaluation: (B,) the same under the reference
PAIR_MARGIN = "pair_margin"  # preference pairs: (B,) the pair's margin (reward-model training), on both its rows
SEQUENCE_SCORE = "sequence_score"  # reward-model evaluation: (B,) the model's score of each row

# ---- meta_info keys ---------------------------------------------------------------------------
GLOBAL_STEP = "global_step"  # the training step a call belongs to (seeds derive from it)
SAMPLING = "sampling"  # generation settings to use: one of SAMPLING_MODES
SAMPLING_ROUND = "sampling_round"  # dynamic sampling: the step's generation round (0 first; seeds derive from it)
RECORD_ROUTES = "record_routes"  # training samples of a mixture of experts: return routed_experts (routing replay)
OLD_POLICY = "old_policy"  # "rollout": the update uses the rollout's log-probs as the old policy (bypass mode)
METRICS = "metrics"  # a worker's measurements {name: float}; collected as the mean over ranks
SFT_LOSS = "sft/loss"  # the SFT metric: a batch's mean negative log-likelihood per trained token
BATCH_SCALE = "batch_scale"  # an update's batch is this many times the planned one (branches): mini-batches too
INTERRUPT_KEY = "interrupt_key"  # partial rollout: the store key whose presence stops the call (rollout/interrupt.py)

SAMPLING_MODES = ("train", "validate", "greedy")
