"""Everything one simulator instance is told at start: what it serves and how fast it is."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SimConfig:
    model: str = "demo-model"
    host: str = "127.0.0.1"
    port: int = 0  # 0 picks a free port; the running handle reports the real one

    # Scheduler, with vLLM's defaults for an online server.
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192

    # KV cache: 4096 blocks x 16 tokens = 65,536 tokens, room for ~64 sequences of ~1k tokens.
    block_size: int = 16
    num_gpu_blocks: int = 4096
    enable_prefix_caching: bool = True

    # Output length when the request gives no max_tokens.
    default_max_tokens: int = 16

    # Step time model (milliseconds of GPU time); see README "Timing model".
    step_base_ms: float = 6.0
    prefill_token_ms: float = 0.035
    decode_seq_ms: float = 0.08

    # 10 means ten times faster than real time.
    speed: float = 1.0

    # Like vLLM's --api-key: /v1/* requests must carry `Authorization: Bearer <key>` (else 401).
    api_key: str | None = None

    def __post_init__(self) -> None:
        positive = {
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
            "num_gpu_blocks": self.num_gpu_blocks,
            "default_max_tokens": self.default_max_tokens,
            "speed": self.speed,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        for name in ("step_base_ms", "prefill_token_ms", "decode_seq_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0..65535, got {self.port}")
        if not self.model:
            raise ValueError("model must not be empty")
        # Like vLLM at start-up: a sequence of max_model_len tokens must fit in the KV cache,
        # otherwise a long request could wait forever.
        capacity = self.num_gpu_blocks * self.block_size
        if self.max_model_len > capacity:
            raise ValueError(
                f"max_model_len {self.max_model_len} does not fit in the KV cache "
                f"({self.num_gpu_blocks} blocks x {self.block_size} tokens = {capacity} tokens)"
            )
