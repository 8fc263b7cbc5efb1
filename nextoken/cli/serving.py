"""``nextoken serve`` and ``inspect``: the HTTP server (and the inspector's page)."""

from __future__ import annotations

from nextoken.cli.common import engine_args


def _server_args(a):
    from nextoken.server.args import ServerArgs

    return ServerArgs.from_cli_args(a)


def cmd_serve(a) -> int:
    if a.replicas:
        from nextoken.server.replicas import serve_replicas

        return serve_replicas(a, a.argv[a.argv.index("serve") + 1:])
    return _serve(a)


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
