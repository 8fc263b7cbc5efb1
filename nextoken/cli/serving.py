"""``nextoken serve`` and ``inspect``: the HTTP server (and the inspector's page)."""

from __future__ import annotations

from nextoken.cli.common import engine_args


def _server_args(a):
    """The command line's `ServerArgs`, checked (`ServerArgs.check`: one line, before any load)."""
    from nextoken.server.args import ServerArgs

    args = ServerArgs.from_cli_args(a)
    args.check()
    return args


def cmd_serve(a) -> int:
    if a.replicas:
        from nextoken.server.replicas import serve_replicas

        _server_args(a)  # (checked here, before the replicas start: each checks its own again)
        return serve_replicas(a, a.argv[a.argv.index("serve") + 1:])
    return _serve(a)


def cmd_run_batch(a) -> int:
    """``nextoken run-batch -i FILE -o FILE``: every request of the file through the server's
    app (`server.batch`); the answers written in order."""
    import json
    import sys

    from nextoken.errors import InvalidRequest
    from nextoken.server.args import ServerArgs
    from nextoken.server.batch import run_batch

    try:
        text = sys.stdin.read() if a.input_file == "-" else open(a.input_file, encoding="utf-8").read()
    except OSError as exc:
        raise InvalidRequest(f"cannot read {a.input_file}: {exc.strerror}", "input_file") from None
    records = run_batch(engine_args(a), ServerArgs(served_model_name=a.served_model_name, inspect=False), text)
    out = "".join(json.dumps(r) + "\n" for r in records)
    if a.output_file == "-":
        sys.stdout.write(out)
    else:
        with open(a.output_file, "w", encoding="utf-8") as fh:
            fh.write(out)
    failed = sum(r["error"] is not None or r["response"]["status_code"] >= 400 for r in records)
    print(f"{len(records)} requests, {failed} failed" + ("" if a.output_file == "-" else f"; answers in {a.output_file}"),
          file=sys.stderr)
    return 0


def cmd_inspect(a) -> int:
    return _serve(a, announce_inspector=True)


def _serve(a, announce_inspector: bool = False) -> int:
    """One server process, or several over one engine process (``--api-server-count``)."""
    server_args = _server_args(a)
    if server_args.api_server_count > 1:
        from nextoken.server.api_servers import serve_api_servers

        return serve_api_servers(engine_args(a), server_args, announce_inspector)
    from nextoken.server.serve import serve

    return serve(engine_args(a), server_args, announce_inspector)
