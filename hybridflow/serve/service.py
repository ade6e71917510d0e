"""The training service without HTTP (app.py serves it): one class made of its parts, each a file of one concern.

    state.py      the records, the worker's calls, futures, ownership lookups
    sessions.py   the SDK's settings, sessions and their heartbeats, freeing what an ended session held
    training.py   training models, each model's requests in seq_id order, forward_backward and the optimizer step
    weights.py    saving and loading weights under tinker:// paths
    sampling.py   sampling sessions and sample requests, batched by equal settings

A client's mistake fails only its own request: models, samplers and results are each owned by one session (saved
paths by one API key), and nothing one client sends reaches another's state.
"""

from __future__ import annotations

from hybridflow.serve.sessions import SessionsPart
from hybridflow.serve.state import Backend, ServedModel
from hybridflow.serve.weights import WeightsPart

__all__ = ["Backend", "ServedModel", "TrainingService"]


class TrainingService(SessionsPart, WeightsPart):
    """The whole service: ``TrainingService(config, backend, served, api_keys)`` (state.py's constructor)."""
