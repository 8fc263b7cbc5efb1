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
    from nextoken.server.serve import serve

    return serve(engine_args(a), _server_args(a))


def cmd_inspect(a) -> int:
    from nextoken.server.serve import serve

    return serve(engine_args(a), _server_args(a), announce_inspector=True)
