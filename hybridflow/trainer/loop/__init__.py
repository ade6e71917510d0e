"""The one step loop (step_loop.py) and the trainers it runs: RL (rl_trainer.py, with its generation and the
training modes' parts: where a batch comes from, when the weights move) and SFT (sft_trainer.py)."""
