"""`s2moe serve`: the model behind an OpenAI-compatible HTTP API, for the editors, agents and notebooks that
already speak llama-server's: /health, /v1/models, /v1/completions and /v1/chat/completions (the GGUF's own chat
template), streamed as server-sent events, with the decoding's own figures in each response (field "s2moe").

One generation runs at a time on the one decoder, in a thread of its own; the requests behind it wait in order, at
most --queue of them, and the rest get 503 with Retry-After. A client that goes away stops its generation at the
next step, and so do SIGINT and SIGTERM, which answer the request in flight before the server exits (130, 143).
Starlette and uvicorn speak HTTP; openai_api reads requests and shapes answers; the engine decodes.
"""

from __future__ import annotations

import os
import socket

from ..engine.errors import ConfigError

WARM_UP_PROMPT = "def add(a, b):\n    return"
API_KEY_ENV = "S2MOE_API_KEY"


def _port(text: str) -> int:
    import argparse

    from .options import whole_number

    v = whole_number(text)
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port from 0 (a free one) to 65535, got {v}")
    return v


def add_parser(sub) -> None:
    from .options import _non_negative_int, add_generation_options, nonempty

    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API (llama-server's endpoints)")
    add_generation_options(p)
    # as llama-server's: a request that sets no seed samples with one of its own (the response says which)
    helps = {
        "n_predict": "tokens a request generates when it sets no max_tokens (default: until the context is full)",
        "seed": "seed of a request that sets none (default -1: a random one each, said in its response)",
    }
    for action in p._actions:
        action.help = helps.get(action.dest, action.help)
    p.add_argument(
        "--host",
        type=nonempty,
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1, this machine only: reach it from another over "
        "`ssh -L`; another address is open to the network, so give it an --api-key)",
    )
    p.add_argument("--port", type=_port, default=8080, help="TCP port (default 8080; 0: a free one, printed)")
    p.add_argument(
        "--api-key",
        type=nonempty,
        default=None,
        help=f"require `Authorization: Bearer KEY` on every endpoint but /health (default: the "
        f"{API_KEY_ENV} environment variable, which keeps the key out of the process list; unset: "
        "none)",
    )
    p.add_argument(
        "-a",
        "--alias",
        type=nonempty,
        default=None,
        help="the model's name in /v1/models and responses (default: the file's name without .gguf)",
    )
    p.add_argument(
        "--queue",
        type=_non_negative_int,
        default=8,
        help="requests that may wait behind the one generating (default 8); more get 503 with Retry-After",
    )
    p.set_defaults(run=run, n_predict=None, seed=-1)


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (checked before a model loads: a port in use is one line, not a traceback)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        raise ConfigError(f"cannot listen on {host}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def run(args) -> int:
    from dataclasses import replace
    from pathlib import Path

    from ..engine import offload
    from ..engine.decoding.decoder import Decoder
    from ..engine.decoding.generation_config import GenerationConfig
    from ..engine.model_info import read_model_info
    from .model_runs import cpu_buffers_for, default_model, generation_config, offload_under_budget, run_cli_in_budget
    from .options import placement_from_args, sampling_settings, tree_mode
    from .server import Service, serve

    model = args.model if args.model is not None else default_model()
    GenerationConfig(
        mode=tree_mode(args),
        n_predict=args.n_predict or 1,
        draft_topk=args.draft_topk,
        draft_max=args.draft_max,
        tree_width=args.tree_width,
        tree_max_nodes=args.tree_max_nodes,
        **sampling_settings(args),
    ).validate()
    placement = placement_from_args(args)
    read_model_info(model)  # a missing or damaged model is said before anything listens
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    budget = offload.Budget.parse(args.budget) if args.budget is not None else None
    if budget is not None and offload.current_budget() is None:
        listening_socket(args.host, args.port).close()  # the child listens; a port in use is said here first
        return run_cli_in_budget(args._argv, budget, model, tag="serve")
    sock = listening_socket(args.host, args.port)
    try:
        cpu = cpu_buffers_for(model, budget is None)
        decoder = Decoder(
            model,
            n_ctx=args.ctx,
            n_threads=args.threads,
            max_draft=max(16, args.draft_max or 0),
            use_extra_bufts=cpu.extra,
            placement=placement,
            n_batch=args.batch_size,
        )
        offloader = None
        try:
            default_tokens = args.n_predict
            args.n_predict = args.n_predict or decoder.n_ctx  # the base config's; each request sets its own
            if budget is not None:

                def warm_up():  # every graph shape a request takes, so that an auto budget counts them
                    short = replace(generation_config(args, decoder), n_predict=8, stop_at_eos=False)
                    for _ in decoder.generate(WARM_UP_PROMPT, short):
                        pass

                offloader, _ = offload_under_budget(args, decoder, budget, warm_up)
            base = generation_config(args, decoder)
            alias = args.alias or Path(model).name.removesuffix(".gguf")
            service = Service(
                decoder, base, alias=alias, queue=args.queue, api_key=api_key, default_tokens=default_tokens
            )
            serve(service, sock, args.host)
        finally:
            if offloader is not None:
                offloader.close()
            decoder.close()
    finally:
        sock.close()
    return 0
