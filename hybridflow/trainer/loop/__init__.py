"""The one step loop (step_loop.py) and the trainers it runs: RL (rl_trainer.py, with its generation and the
training modes' parts: where a batch comes from, when the weights move) and the supervised one
(supervised_trainer.py: SFT, DPO, the reward model, any registered objective)."""
