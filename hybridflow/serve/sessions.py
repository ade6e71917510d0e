"""The service and its sessions: the SDK's settings, the served model, sessions started, kept alive by heartbeats,
ended (by the client or by a timeout), and everything a session held freed with it."""

from __future__ import annotations

import time
import uuid

from hybridflow.serve import messages as m
from hybridflow.serve.futures import ServiceError
from hybridflow.serve.state import ServiceState, Session, log

# The least a datum the SDK sends can weigh per token in the SDK's estimate of a forward_backward chunk (tinker 0.38.0,
# training_client._estimate_datum_bytes_count_proto): its token (int32, 4 bytes), its target token (int64: the SDK's
# tensors are int64 or float32) and at least one float32 loss input (weights, or advantages). A chunk within
# ``tokens * SDK_MIN_BYTES_PER_TOKEN`` bytes holds at most ``tokens`` tokens.
SDK_MIN_BYTES_PER_TOKEN = 4 + 8 + 4


class SessionsPart(ServiceState):
    def client_config(self) -> dict:
        """The SDK's settings for this service: plain API keys, uncompressed bodies, and forward_backward calls
        chunked within the request bounds (so a well-behaved client never meets them). The SDK takes a bound on a
        chunk's datums and one on its estimated bytes, not on its tokens: the bytes told are few enough that a chunk
        within them holds at most ``limits.max_tokens_per_request`` tokens (a single datum over them goes alone,
        and holds at most ``max_tokens_per_datum``, which is no more), and half the body bound (room for protobuf's
        framing, which the estimate leaves out)."""
        limits = self.limits
        chunk_bytes = min(limits.max_body_bytes // 2, limits.max_tokens_per_request * SDK_MIN_BYTES_PER_TOKEN)
        return {
            "pjwt_auth_enabled": False,
            "parallel_fwdbwd_chunks": True,
            "proto_compress_fwdbwd": False,
            "fwdbwd_max_chunk_len": limits.max_datums_per_request,
            "fwdbwd_max_chunk_bytes_count": chunk_bytes,
            "sample_use_retrieve_futures": False,
            "custom_loss_server_side": False,
            "sample_join_sampling_session": False,
            "use_pyqwest_transport": False,
        }

    def capabilities(self) -> dict:
        return {
            "supported_models": [
                {
                    "model_name": self.served.name,
                    "max_context_length": self.served.max_context,
                    "trainable": True,
                    "sampleable": True,
                }
            ]
        }

    def create_session(self, owner: str, request: m.CreateSession) -> dict:
        self.expire_sessions()
        if len(self.sessions) >= self.limits.max_sessions:
            raise ServiceError(f"the service holds its limit of {self.limits.max_sessions} sessions; try later", 400)
        session = Session(uuid.uuid4().hex, owner, time.monotonic())
        self.sessions[session.id] = session
        log.info("session %s started (%s)", session.id, request.display_name or "unnamed")
        return {"type": "create_session", "session_id": session.id}

    def heartbeat(self, owner: str, session_id: str) -> dict:
        self.session(owner, session_id)
        return {"type": "session_heartbeat"}

    def end_session(self, session: Session) -> None:
        """Free what the session held: its models' adapters and its snapshots."""
        self.sessions.pop(session.id, None)
        for model_id in sorted(session.models):
            self.models.pop(model_id, None)
            self._submit(None, lambda key=model_id: self.backend.drop_adapter(key))
        for sampler_id in session.samplers:
            self.samplers.pop(sampler_id, None)
        for snapshot in session.snapshots:
            self._submit(None, lambda saved=snapshot: self.storage.remove(saved))
        log.info("session %s ended: %d models freed", session.id, len(session.models))

    def expire_sessions(self) -> None:
        deadline = time.monotonic() - self.config.service.session_timeout_s
        for session in [s for s in self.sessions.values() if s.last_seen < deadline]:
            log.info("session %s sent no heartbeat for %.0f s", session.id, self.config.service.session_timeout_s)
            self.end_session(session)
