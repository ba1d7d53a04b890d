"""Command line: `python -m llm_runtime prepare | generate | bench | roofline | serve | router`.

    python -m llm_runtime prepare                      # convert the bundled model into the cache (once)
    python -m llm_runtime generate "What is 2 + 2?"    # one chat answer, greedy
    python -m llm_runtime bench                        # the engine against transformers (see bench --help)
    python -m llm_runtime roofline                     # batch-1 decode against the memory-bandwidth limit
    python -m llm_runtime serve --port 8000            # an OpenAI-compatible HTTP server
    python -m llm_runtime router --replica URL URL     # a router in front of several servers (lesson 18)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from .config import KV_CACHE_DTYPES
from .model.quantized_linear import QUANTIZATIONS

# Shapes a server's oneDNN and ideep caches keep each (1,024 by default). scripts/soak.py, 10 min, int8 KV
# with a 4-bit draft: resident memory grew 2,930 -> 4,270 MiB at 1,024 and held at 3,198-3,199 MiB at 64.
SERVE_SHAPE_CACHE_CAPACITY = 64


def _kv_transfer_config(text: str):
    """`--kv-transfer-config JSON` -> KVTransferConfig (argparse reports a ValueError as a usage error), its
    kv_secret from LLM_RUNTIME_KV_SECRET when the JSON gives none (a secret in the environment stays out of `ps`)."""
    from .kv_transfer.config import KVTransferConfig
    from .kv_transfer.trust import SECRET_ENV

    try:
        return KVTransferConfig.from_json(text, secret=os.environ.get(SECRET_ENV))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def _api_key(given: str | None) -> str | None:
    """--api-key's value, else LLM_RUNTIME_API_KEY's (as vLLM reads VLLM_API_KEY), else None: no key asked."""
    from .serving.middleware import API_KEY_ENV

    return given if given is not None else os.environ.get(API_KEY_ENV) or None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llm_runtime", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    prepare = commands.add_parser("prepare", help="convert the bundled model into the user cache")
    prepare.add_argument("--cache-dir", default=None)
    gen = commands.add_parser("generate", help="answer one chat message")
    gen.add_argument("message")
    gen.add_argument("--model", default=None, help="local folder or hub id (default: bundled SmolLM2)")
    gen.add_argument("--device", default="auto")
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                     help="int8 / int4 linear layers, or the bundled GGUF's own 4-bit blocks (gguf)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--tensor-parallel-size", type=int, default=1,
                     help="split the model over this many ranks (worker processes; lesson 17)")
    from .bench.cli import add_arguments, speculative_config

    add_arguments(commands.add_parser("bench", help="benchmark the engine against transformers"))
    from .bench import decode_roofline

    decode_roofline.add_arguments(commands.add_parser(
        "roofline", help="batch-1 decode per mode (eager, compiled, graphs) against the memory-bandwidth roofline"))
    srv = commands.add_parser("serve", help="an OpenAI-compatible HTTP server")
    srv.add_argument("--model", default=None, help="local folder or hub id (default: bundled SmolLM2)")
    srv.add_argument("--served-model-name", default=None, help="the name clients use (default: from --model)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--device", default="auto")
    srv.add_argument("--dtype", default="auto")
    srv.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                     help="int8 / int4 linear layers, or the bundled GGUF's own 4-bit blocks (gguf)")
    srv.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                     help="how the KV pool stores keys and values: the model's dtype, int8 or fp8 (e4m3)")
    srv.add_argument("--max-num-seqs", type=int, default=32)
    srv.add_argument("--max-model-len", type=int, default=None, help="context offered (default: the model's)")
    srv.add_argument("--max-waiting-requests", type=int, default=256, help="more get 503 (busy)")
    srv.add_argument("--max-request-bytes", type=int, default=2 * 2**20, help="larger bodies get 413")
    srv.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                     help="fraction of device memory this process may use (another process on the GPU? lower it)")
    srv.add_argument("--kv-cache-memory", type=int, default=None, help="the KV pool in bytes (default: the rule)")
    srv.add_argument("--enforce-eager", action="store_true", help="no torch.compile, no CUDA graphs")
    srv.add_argument("--batch-invariant", action="store_true",
                     help="a request's logits bitwise the same whatever runs beside it (the CPU; lesson 16)")
    srv.add_argument("--tensor-parallel-size", type=int, default=1,
                     help="split the model over this many ranks (worker processes; gloo on the CPU; lesson 17)")
    srv.add_argument("--speculative-config", type=speculative_config, default=None, metavar="JSON",
                     help='speculative decoding, as vLLM takes it: \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    srv.add_argument("--kv-transfer-config", type=_kv_transfer_config, default=None, metavar="JSON",
                     help='disaggregated prefill and decode, as vLLM takes it: \'{"kv_connector": "ZmqConnector", '
                          '"kv_role": "kv_producer"}\' (or kv_consumer, kv_both; lesson 18)')
    srv.add_argument("--api-key", default=None,
                     help="a bearer token every /v1 route asks for (or LLM_RUNTIME_API_KEY; default: none asked)")
    srv.add_argument("--enable-dev-routes", action="store_true",
                     help="serve the routes that change the server's state for a measurement (POST "
                          "/reset_prefix_cache), as vLLM's development mode does; never on a shared address")
    srv.add_argument("--check-invariants", action="store_true", help="check the scheduler's books every step")
    srv.add_argument("--verbose", action="store_true",
                     help="print the engine's plan: how it set the model up on this device, choice by choice, and why")
    srv.add_argument("--shape-cache-capacity", type=int, default=SERVE_SHAPE_CACHE_CAPACITY,
                     help="shapes oneDNN and ideep keep compiled primitives for, each (worker/host_memory.py)")
    rtr = commands.add_parser("router", help="an OpenAI-compatible router in front of several servers (lesson 18)")
    rtr.add_argument("--prefill", action="extend", nargs="+", default=[], metavar="URL",
                     help="prefill servers (with --kv-transfer-config kv_producer); with --decode")
    rtr.add_argument("--decode", action="extend", nargs="+", default=[], metavar="URL",
                     help="decode servers (with --kv-transfer-config kv_consumer); with --prefill")
    rtr.add_argument("--replica", action="extend", nargs="+", default=[], metavar="URL",
                     help="data-parallel replicas, each serving whole requests")
    rtr.add_argument("--policy", default="round_robin", choices=("round_robin", "least_loaded", "cache_aware"))
    rtr.add_argument("--host", default="127.0.0.1")
    rtr.add_argument("--port", type=int, default=8080)
    rtr.add_argument("--api-key", default=None,
                     help="a bearer token clients must send (or LLM_RUNTIME_API_KEY; default: none asked)")
    rtr.add_argument("--backend-api-key", default=None, help="the bearer token sent to the backends "
                                                             "(default: --api-key's)")
    rtr.add_argument("--max-request-bytes", type=int, default=2 * 2**20, help="larger bodies get 413")
    args = parser.parse_args(argv)

    if args.command == "prepare":
        from .model import prepare_bundled_model

        print(f"bundled model ready in {prepare_bundled_model(args.cache_dir)}")
        return 0

    if args.command == "bench":
        from .bench.cli import run

        return run(args)

    if args.command == "roofline":
        return decode_roofline.run(args)

    if args.command == "router":
        from .kv_transfer.trust import SECRET_ENV, check_secret
        from .serving.router import run_router

        try:
            secret = os.environ.get(SECRET_ENV) or None  # signs the kv_transfer_params it sets (kv_transfer/trust.py)
            check_secret(secret)
            run_router(args.prefill, args.decode, args.replica, args.policy, args.host, args.port, kv_secret=secret,
                       api_key=_api_key(args.api_key), backend_api_key=args.backend_api_key,
                       max_request_bytes=args.max_request_bytes)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        return 0

    if args.command == "serve":
        from .worker.host_memory import bound_shape_caches

        # Before anything runs oneDNN: a server's step sizes never stop changing (host_memory.py).
        bound_shape_caches(os.environ, args.shape_cache_capacity)
        from . import LLMEngine
        from .config import EngineConfig
        from .model import BUNDLED_MODEL_NAME
        from .serving.async_engine import step_thread
        from .serving.server import serve

        def build() -> LLMEngine:
            return LLMEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype,
                                             quantization=args.quantization,
                                             config=EngineConfig(max_num_seqs=args.max_num_seqs,
                                                            max_model_len=args.max_model_len,
                                                            gpu_memory_utilization=args.gpu_memory_utilization,
                                                            kv_cache_memory=args.kv_cache_memory,
                                                            kv_cache_dtype=args.kv_cache_dtype,
                                                            check_invariants=args.check_invariants,
                                                            enforce_eager=args.enforce_eager,
                                                            batch_invariant=args.batch_invariant,
                                                            tensor_parallel_size=args.tensor_parallel_size,
                                                            speculative_config=args.speculative_config))

        # Built on the thread that will run its steps: PyTorch's CPU threads stay one team (async_engine.py).
        executor = step_thread()
        try:
            engine = executor.submit(build).result()
        except (ValueError, RuntimeError) as error:
            executor.shutdown()
            print(f"error: {error}", file=sys.stderr)
            return 2
        if args.verbose:
            print(engine.stats().plan, file=sys.stderr)
        name = args.served_model_name or (str(args.model).rstrip("/").split("/")[-1] if args.model
                                          else BUNDLED_MODEL_NAME)
        serve(engine, name, args.host, args.port, args.max_waiting_requests, args.max_request_bytes, executor,
              args.kv_transfer_config, _api_key(args.api_key), args.enable_dev_routes)
        return 0

    from . import LLM, SamplingParams, encode_chat, generate, load_model

    try:
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
        if args.tensor_parallel_size > 1:  # the engine: it drives the ranks
            llm = LLM(args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
                      tensor_parallel_size=args.tensor_parallel_size)
            model, tokenizer = llm.model, llm.get_tokenizer()
        else:
            llm = None
            model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype,
                                          quantization=args.quantization)
    except (ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    prompt = encode_chat(tokenizer, [{"role": "user", "content": args.message}])
    start = time.perf_counter()
    if llm is not None:
        with llm:
            tokens = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    else:
        tokens = generate(model, prompt, params)
    elapsed = time.perf_counter() - start
    print(tokenizer.decode(tokens, skip_special_tokens=True), flush=True)
    print(f"[{len(tokens)} tokens in {elapsed:.2f} s on {model.device}, {model.dtype}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
