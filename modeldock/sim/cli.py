"""`modeldock sim`: serve one simulated model until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from modeldock.sim.config import SimConfig
from modeldock.sim.server import start_simulator

log = logging.getLogger("modeldock.sim")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = SimConfig()
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument(
        "--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default: %(default)s)"
    )
    parser.add_argument("--model", default=d.model, help="the one model name served (default: %(default)s)")
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=d.max_num_seqs,
        help="most sequences running in one step (default: %(default)s)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="token budget of one step; longer prefills are chunked (default: %(default)s)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=d.max_model_len,
        help="longest prompt + output in tokens (default: %(default)s)",
    )
    parser.add_argument(
        "--block-size", type=int, default=d.block_size, help="tokens per KV block (default: %(default)s)"
    )
    parser.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=d.num_gpu_blocks,
        help="KV cache capacity in blocks; the default fits ~64 sequences of ~1k tokens (default: %(default)s)",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_caching,
        help="reuse KV blocks of shared prompt prefixes (default: on)",
    )
    parser.add_argument(
        "--default-max-tokens",
        type=int,
        default=d.default_max_tokens,
        help="reply length when a request sets no max_tokens (default: %(default)s)",
    )
    parser.add_argument(
        "--step-base-ms", type=float, default=d.step_base_ms, help="fixed cost of one step, ms (default: %(default)s)"
    )
    parser.add_argument(
        "--prefill-token-ms",
        type=float,
        default=d.prefill_token_ms,
        help="added step cost per prompt token computed, ms (default: %(default)s)",
    )
    parser.add_argument(
        "--decode-seq-ms",
        type=float,
        default=d.decode_seq_ms,
        help="added step cost per decoding sequence, ms (default: %(default)s)",
    )
    parser.add_argument(
        "--speed",
        type=float,
        default=d.speed,
        help="time factor: 10 runs ten times faster than real time (default: %(default)s)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("VLLM_API_KEY"),
        help="like vLLM: /v1/* requests need `Authorization: Bearer KEY`, else 401 (default: $VLLM_API_KEY, or none)",
    )


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        model=args.model,
        host=args.host,
        port=args.port,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
        default_max_tokens=args.default_max_tokens,
        step_base_ms=args.step_base_ms,
        prefill_token_ms=args.prefill_token_ms,
        decode_seq_ms=args.decode_seq_ms,
        speed=args.speed,
        api_key=args.api_key or None,
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        log.error("modeldock sim: %s", exc)
        return 2
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_serve(config))
    return 0


async def _serve(config: SimConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    simulator = await start_simulator(config)
    log.info("modeldock sim serving model %r at %s/v1 (speed %gx)", config.model, simulator.url, config.speed)
    try:
        await stop.wait()
    finally:
        await simulator.stop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
