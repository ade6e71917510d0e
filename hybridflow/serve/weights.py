"""Saving and loading: a model's weights (with its optimizer state) or its sampler weights under tinker:// paths in
the storage (storage.py), and loads into an existing model or one the load creates; each in the model's order."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

from hybridflow.serve import messages as m
from hybridflow.serve.futures import ServiceError
from hybridflow.serve.sampling import SamplingPart
from hybridflow.serve.state import Sampler, TrainingModel
from hybridflow.serve.storage import PathError, SavedPath, check_name, parse_path
from hybridflow.serve.training import TrainingPart
from hybridflow.workers.adapter_service import AdapterSpec


class WeightsPart(TrainingPart, SamplingPart):
    def _meta(self, model: TrainingModel, with_optimizer: bool) -> dict:
        return {
            "base_model": self.served.name,
            "rank": model.spec.rank,
            "parts": sorted(model.spec.parts),
            "scaling": model.spec.scaling,
            "with_optimizer": with_optimizer,
            "saved_at": time.time(),
        }

    def _save_job(self, owner: str, model: TrainingModel, saved: SavedPath, with_optimizer: bool, overwrite: bool):
        meta = self._meta(model, with_optimizer)

        def write(scratch: Path) -> None:
            self.backend.save_adapter(model.id, str(scratch), with_optimizer)

        def save() -> None:
            self.storage.save(saved, owner, meta, write, overwrite=overwrite)
            # a sampler of this path reads the new weights from now on, not what the worker holds of the old ones
            self.backend.forget_sampler(saved.uri)

        return save

    def save_weights(self, owner: str, request: m.SaveWeights) -> dict:
        def prepare(model: TrainingModel) -> Callable:
            name = request.path or f"step-{request.seq_id}"
            check_name(name)
            saved = parse_path(f"tinker://{model.id}/weights/{name}")
            save = self._save_job(owner, model, saved, True, request.overwrite)

            def run() -> dict:
                save()
                return {"type": "save_weights", "path": saved.uri}

            return run

        return self._ordered_job(owner, request.model_id, request.seq_id, prepare)

    def save_weights_for_sampler(self, owner: str, request: m.SaveWeightsForSampler) -> dict:
        def prepare(model: TrainingModel) -> Callable:
            session = self.sessions[model.session]
            if request.path is None and request.sampling_session_seq_id is None:
                raise ValueError("give a path (a name) or a sampling_session_seq_id")
            if request.path is not None:
                check_name(request.path)
                saved = parse_path(f"tinker://{model.id}/sampler_weights/{request.path}")
            else:
                saved = parse_path(f"tinker://{model.id}/sampler_weights/snapshot-{uuid.uuid4().hex[:12]}")
                session.snapshots.append(saved)
                sampler_id = self._sampler_id(session, request.sampling_session_seq_id)
            save = self._save_job(owner, model, saved, False, request.path is not None)

            def run() -> dict:
                save()
                if request.path is not None:
                    return {"type": "save_weights_for_sampler", "path": saved.uri}
                self.samplers[sampler_id] = Sampler(
                    sampler_id, session.id, saved.uri, str(self.storage.directory(saved)), model.spec, saved.uri
                )
                session.samplers.add(sampler_id)
                return {"type": "save_weights_for_sampler", "sampling_session_id": sampler_id}

            return run

        return self._ordered_job(owner, request.model_id, request.seq_id, prepare)

    def load_weights(self, owner: str, request: m.LoadWeights) -> dict:
        """Into an existing model (``model_id`` and ``seq_id``), or creating one (``session_id`` and
        ``model_seq_id``: the load is its first request)."""
        try:
            saved, directory, meta = self.storage.read(request.path, owner)
            spec = self._spec_of(meta, request.path)
        except PathError as error:
            raise ServiceError(str(error), error.status) from None
        except ValueError as error:
            raise ServiceError(str(error)) from None
        if request.optimizer and not meta.get("with_optimizer"):
            raise ServiceError(f"{request.path} holds no optimizer state (saved for sampling); load it without", 400)
        if request.session_id is not None:
            if request.model_seq_id is None:
                raise ServiceError("a load that creates a model needs model_seq_id", 400)
            session = self.session(owner, request.session_id)
            self._check_base(request.base_model)
            model_id = f"{session.id}:train:{request.model_seq_id}"
            self._room_for_model(session, model_id)
            model = self._add_model(session, model_id, spec)
            request_id = self._new_request(owner)
            self._submit(request_id, self._load_job(model, directory, spec, request, fresh=True))
            return {"request_id": request_id, "model_id": model_id}
        if request.model_id is None or request.seq_id is None:
            raise ServiceError("load_weights needs model_id and seq_id, or session_id and model_seq_id", 400)

        def prepare(model: TrainingModel) -> Callable:
            if (model.spec.rank, model.spec.parts) != (spec.rank, spec.parts):
                raise ValueError(
                    f"{request.path} is rank {spec.rank} on {sorted(spec.parts)}; model {model.id} is rank "
                    f"{model.spec.rank} on {sorted(model.spec.parts)}"
                )
            return self._load_job(model, directory, spec, request, fresh=False)

        return self._ordered_job(owner, request.model_id, request.seq_id, prepare)

    def _load_job(self, model: TrainingModel, directory: Path, spec: AdapterSpec, request: m.LoadWeights, fresh: bool):
        def run() -> dict:
            if not fresh:
                self.backend.drop_adapter(model.id)
            self.backend.load_adapter(model.id, str(directory), spec, request.optimizer)
            return {"type": "load_weights", "path": request.path, "model_id": model.id}

        return run
