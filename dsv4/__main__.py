"""Command line: `python -m dsv4 <command> ...`.

Each command is one `_add_<command>(subparsers)` function that declares its flags and sets
`func` to the function that runs it; heavy imports happen inside that function so `--help` and
unrelated commands start fast.
"""

from __future__ import annotations

import argparse
import sys


def _make_tiny(args: argparse.Namespace) -> int:
    from dsv4.tiny import make_tiny

    path = make_tiny(args.out, preset=args.preset, fmt=args.format, seed=args.seed)
    print(f"wrote {args.preset} checkpoint ({args.format}, seed {args.seed}) to {path}")
    return 0


def _add_make_tiny(commands) -> None:
    p = commands.add_parser("make-tiny", help="write a small random DeepSeek-V4 checkpoint directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--preset", choices=["tiny", "small"], default="tiny")
    p.add_argument("--format", choices=["bf16", "fp8"], default="bf16", help="fp8: FP8 weights and FP4 experts, as DeepSeek ships")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_make_tiny)


def _serve(args: argparse.Namespace) -> int:
    from dsv4.config import ConfigError, ServerArgs

    try:
        server_args = ServerArgs.from_cli(args)
    except ConfigError as e:
        print(f"python -m dsv4 serve: {e}", file=sys.stderr)
        return 2
    _configure_logging(server_args.log_level)  # before loading, so the model's origin is logged first
    if server_args.tp_size == 1:
        return _serve_http(server_args)
    # Tensor parallelism: a thread may still sit in a collective that can no longer complete, and
    # torch.distributed's teardown may wait on it; the process ends at once with its code instead.
    try:
        code = _serve_http(server_args) if server_args.node_rank == 0 else _serve_follower_node(server_args)
    except Exception as e:  # noqa: BLE001 -- the group could not form or load: said once, exit non-zero
        print(f"python -m dsv4 serve: {type(e).__name__}: {e}", file=sys.stderr)
        code = 2
    _exit_now(code)


def _serve_http(server_args) -> int:
    from dsv4.engine.pd import engine_for  # a plain Engine unless --disaggregation-mode says otherwise
    from dsv4.server.app import run_server

    return run_server(engine_for(server_args), server_args)


def _serve_follower_node(server_args) -> int:
    """--node-rank > 0: this node's ranks follow rank 0 (on node 0); no HTTP here."""
    from dsv4.engine.follower import run_follower
    from dsv4.engine.launch import start_node

    group, ranks = start_node(server_args)
    try:
        return run_follower(server_args, group)
    finally:
        ranks.stop()


def _exit_now(code: int):
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _rank(args: argparse.Namespace) -> int:
    from dsv4.dist.ranks import decode_args, die_with_parent

    die_with_parent()
    server_args = decode_args(args.server_args)
    _configure_logging(server_args.log_level)

    from dsv4.engine.follower import run_follower
    from dsv4.engine.launch import join_group

    try:
        code = run_follower(server_args, join_group(server_args, args.rank, args.dist_init_addr))
    except Exception as e:  # noqa: BLE001 -- could not join: said once, exit non-zero
        print(f"python -m dsv4 rank {args.rank}: {type(e).__name__}: {e}", file=sys.stderr)
        code = 2
    _exit_now(code)


def _add_rank(commands) -> None:
    # Started by `serve --tp-size N` for each of its node's other ranks; not for people.
    p = commands.add_parser("rank")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--dist-init-addr", required=True)
    p.add_argument("--server-args", required=True, help="ServerArgs as msgspec JSON")
    p.set_defaults(func=_rank)


def _add_serve(commands) -> None:
    from dsv4.config import ServerArgs

    p = commands.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible and native routes)")
    ServerArgs.add_cli_args(p)
    p.set_defaults(func=_serve)


def _generate(args: argparse.Namespace) -> int:
    import asyncio

    from dsv4.config import ServerArgs
    from dsv4.engine.engine import Engine
    from dsv4.protocol import GenerationRequest, SamplingParams

    _configure_logging("warning")
    engine = Engine.from_args(ServerArgs(model=args.model, dtype=args.dtype))
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)

    async def run() -> int:
        await engine.start()
        try:
            request = GenerationRequest(rid="generate", input_ids=tuple(engine.tokenizer.encode(args.prompt)),
                                        sampling=sampling)
            async for out in engine.submit(request):
                print(out.text, end="", flush=True)
                if out.error:
                    print(f"\npython -m dsv4 generate: {out.error}", file=sys.stderr)
                    return 1
            print()
            return 0
        finally:
            await engine.stop()

    return asyncio.run(run())


def _add_generate(commands) -> None:
    from dsv4.config import DTYPE_CHOICES

    p = commands.add_parser("generate", help="generate text offline, without HTTP")
    p.add_argument("--model", default=None, help="checkpoint directory; default: the built-in demo model")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=_generate)


def _configure_logging(level: str) -> None:
    import logging

    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dsv4", description="DeepSeek-V4 server and tools")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_make_tiny(commands)
    _add_serve(commands)
    _add_generate(commands)
    _add_rank(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
