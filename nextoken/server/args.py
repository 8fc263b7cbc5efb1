"""`ServerArgs`: every server option, defined once (as `EngineArgs` is for the engine).

    parser -> ServerArgs.add_cli_args(parser)       # `serve` and `inspect`
    args   -> ServerArgs.from_cli_args(namespace).for_model(engine_args.model)
           -> build_app(state, args)                 # `server.app`

Tests and embedders construct it directly: ``ServerArgs(model_name="tiny", api_key="k")``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from nextoken.cli_args import CliArgs, opt, positive_int

PARSERS = ("qwen3", "deepseek_r1")  # `server.chat.reasoning`'s styles (restated: this module imports no server code)

ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random", "consistent_hash")


@dataclass
class ServerArgs(CliArgs):
    """How the HTTP server runs. `model_name` is what clients send as ``model`` (no flag:
    `for_model` sets it from ``--served-model-name`` or ``--model``)."""

    host: str = opt("127.0.0.1", "address to bind (127.0.0.1: this machine only)", group="server")
    port: int = opt(8000, "port to listen on", group="server", type=int)
    api_key: str | None = opt(None, "require 'Authorization: Bearer KEY' on every route but /health (or set "
                              "NEXTOKEN_API_KEY)", group="server", metavar="KEY")
    served_model_name: list = opt([], "the model names clients use: the first is the one reported, each is "
                                      "accepted (vLLM's; default: --model)", group="server", nargs="+", metavar="NAME")
    embedding_model: str | None = opt(None, "also serve this embedding model (a catalog name or a path) on "
                                      "/v1/embeddings, /v1/score and /v1/rerank, beside --model", group="server",
                                      metavar="MODEL")
    max_queued_requests: int = opt(256, "waiting requests before 429", group="server", type=int)
    max_body_bytes: int = opt(1 << 20, "largest request body, bytes (413 beyond)", group="server", type=int)
    max_tokens_default: int | None = opt(4096, "most tokens a request that sets no output limit generates, on "
                                         "every API (chat, responses, Ollama; a model that never stops would "
                                         "hold its slot to the end of the context)",
                                         group="server", type=positive_int, metavar="N")
    allowed_origins: list = opt([], "CORS origins (default: none)", group="server", nargs="*", metavar="ORIGIN")
    allowed_methods: list = opt(["*"], "with --allowed-origins: the CORS methods allowed (vLLM's flag)",
                                group="server", nargs="*", metavar="METHOD")
    allowed_headers: list = opt(["*"], "with --allowed-origins: the CORS request headers allowed (vLLM's flag)",
                                group="server", nargs="*", metavar="HEADER")
    allow_credentials: bool = opt(False, "with --allowed-origins: CORS requests may carry credentials (cookies, "
                                         "Authorization; vLLM's flag)", group="server", cli="true")
    root_path: str | None = opt(None, "the path prefix a proxy serves this server under, e.g. /llm (FastAPI's "
                                "root_path, vLLM's flag): the proxy strips it, the OpenAPI schema and the inspector "
                                "keep it", group="server", metavar="PATH")
    ssl_keyfile: str | None = opt(None, "serve HTTPS: the private key's PEM file (with --ssl-certfile; vLLM's)",
                                  group="server", metavar="FILE")
    ssl_certfile: str | None = opt(None, "serve HTTPS: the certificate chain's PEM file (with --ssl-keyfile)",
                                   group="server", metavar="FILE")
    ssl_ca_certs: str | None = opt(None, "with HTTPS: the CA certificates that client certificates are checked "
                                   "against (--ssl-cert-reqs)", group="server", metavar="FILE")
    ssl_cert_reqs: int = opt(0, "with HTTPS: client certificates 0 not asked, 1 optional, 2 required (Python's "
                             "ssl.CERT_*; vLLM's)", group="server", type=int, choices=(0, 1, 2), metavar="N")
    timeout_keep_alive: float = opt(75.0, "seconds an idle keep-alive connection stays open (uvicorn's 5 s default "
                                    "closes it as httpx and the openai SDK, whose pools keep one 5 s, reuse it: "
                                    "a ReadError on the client)", group="server", type=float, metavar="S")
    shutdown_timeout: float = opt(30.0, "seconds in-flight requests get to finish after SIGTERM", group="server",
                                  type=float)
    responses_store: int = opt(100, "responses kept for previous_response_id and GET /v1/responses/{id} (least "
                               "recently used first out; 0: none)", group="server", type=int, metavar="N")
    reasoning_parser: str | None = opt(None, "separate a thinking model's <think>...</think> from its answer: "
                                       "qwen3 (a thought when the answer opens with <think>) or deepseek_r1 (the "
                                       "template opens the thought)", group="server", choices=PARSERS)
    enable_auto_tool_choice: bool = opt(False, "accepted as vLLM's command line takes it, and changes nothing: a "
                                               "request's tools are always parsed (tool_choice auto)", group="server",
                                        cli="true")
    tool_call_parser: str | None = opt(None, "the tool-call format: hermes (Qwen2.5's), the one parsed; vLLM's "
                                             "flag, which names another format, is refused", group="server",
                                       choices=("hermes",))
    trust_request_chat_template: bool = opt(False, "let a chat request's chat_template (a Jinja source, rendered in "
                                                   "Jinja's sandbox) replace the model's (vLLM's flag; without it "
                                                   "such a request is refused)", group="server", cli="true")
    return_tokens_as_token_ids: bool = opt(False, "name the tokens of log-probabilities token_id:N (as a request's "
                                                  "return_tokens_as_token_ids does; vLLM's flag)", group="server",
                                           cli="true")
    enable_request_id_headers: bool = opt(False, "answer every HTTP request with an X-Request-Id header: the "
                                                 "client's X-Request-Id, else a new id, which the request's engine "
                                                 "id and log line carry too (vLLM's flag)", group="server",
                                          cli="true")
    uvicorn_log_level: str = opt("warning", "uvicorn's log level (vLLM's flag; info adds uvicorn's line per HTTP "
                                            "request, its access log)", group="server",
                                 choices=("critical", "error", "warning", "info", "debug", "trace"))
    disable_uvicorn_access_log: bool = opt(False, "no line per HTTP request at --uvicorn-log-level info or below "
                                                  "(vLLM's flag)", group="server", cli="true")
    disable_log_requests: bool = opt(False, "accepted as vLLM's command line takes it, and changes nothing: "
                                            "nextoken logs no line per request (uvicorn's access log aside)",
                                     group="server", cli="true")
    disable_log_stats: bool = opt(False, "accepted as vLLM's command line takes it, and changes nothing: nextoken "
                                         "logs no periodic statistics (they are at /metrics)", group="server",
                                  cli="true")
    lora_modules: list = opt([], "LoRA adapters served as models, NAME=PATH each (PEFT folders; needs "
                             "--enable-lora and --max-loras at least their number)", group="LoRA", nargs="*",
                             metavar="NAME=PATH")
    allow_mcp_url: list = opt([], "MCP servers /v1/responses may call (type mcp tools), as globs of their URL, "
                              "e.g. 'http://127.0.0.1:8931/*' (repeatable; default: none)", group="MCP tools",
                              action="append", metavar="PATTERN")
    mcp_timeout: float = opt(30.0, "seconds an MCP server gets to list its tools or run one call", group="MCP tools",
                             type=float, metavar="S")
    mcp_max_output_bytes: int = opt(1 << 20, "largest MCP tool output kept (a larger one is an error item)",
                                    group="MCP tools", type=int, metavar="N")
    inspect: bool = opt(True, "serve the inspector page and its /inspect/api routes", group="server", cli="bool")
    engine_process: bool = opt(False, "step the engine in a process of its own (vLLM's EngineCore): the HTTP "
                               "work and the engine's host work per step run at once instead of sharing one "
                               "GIL; the inspector is served by the engine process", group="server", cli="bool")
    api_server_count: int = opt(1, "HTTP server processes in front of one engine process (vLLM's "
                                "--api-server-count; more than 1 implies --engine-process): each streams its own "
                                "requests, so the HTTP work of many streams spreads over N cores",
                                group="server", type=positive_int, metavar="N")
    replicas: int | None = opt(None, "start N servers (ports PORT+1..PORT+N, each pinned to its own cores) behind "
                               "vllm-router on --host:--port (needs pip install 'nextoken[router]')",
                               group="replicas", type=positive_int, metavar="N")
    router_policy: str = opt("cache_aware", "with --replicas: how the router picks a replica (cache_aware: requests "
                             "sharing a prompt prefix go to the same replica)", group="replicas",
                             choices=ROUTER_POLICIES)
    model_name: str = opt("nextoken", "the name clients send as model", cli="none")
    model_aliases: tuple = opt((), "the other names clients may send as model (--served-model-name's)", cli="none")
    disconnect_poll_s: float = opt(0.05, "how often a waiting request checks its client is still there",
                                   cli="none")

    def check(self) -> None:
        """Raise `InvalidRequest` naming the first bad combination of options (before anything
        loads): TLS needs both files, readable; a root path starts with /."""
        from nextoken.errors import InvalidRequest

        if bool(self.ssl_keyfile) != bool(self.ssl_certfile):
            raise InvalidRequest("HTTPS needs both --ssl-keyfile and --ssl-certfile", "ssl_certfile" if
                                 self.ssl_keyfile else "ssl_keyfile")
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            path = getattr(self, name)
            if path and not os.access(path, os.R_OK):
                raise InvalidRequest(f"--{name.replace('_', '-')} {path}: no such readable file", name)
        if (self.ssl_ca_certs or self.ssl_cert_reqs) and not self.ssl_certfile:
            field = "ssl_ca_certs" if self.ssl_ca_certs else "ssl_cert_reqs"
            raise InvalidRequest(f"--{field.replace('_', '-')} needs HTTPS (--ssl-keyfile and --ssl-certfile)", field)
        if self.ssl_cert_reqs == 2 and not self.ssl_ca_certs:
            raise InvalidRequest("--ssl-cert-reqs 2 needs --ssl-ca-certs (the CAs a client certificate is checked "
                                 "against)", "ssl_ca_certs")
        if self.root_path is not None and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise InvalidRequest(f"--root-path {self.root_path!r} must start with / and not end with one, e.g. /llm",
                                 "root_path")
        if self.replicas and (self.ssl_certfile or self.root_path):
            raise InvalidRequest("--replicas serves through vllm-router, which nextoken starts without TLS or a root "
                                 "path: put the proxy with them in front of it", "replicas")

    @property
    def scheme(self) -> str:
        """``https`` with --ssl-certfile, else ``http``."""
        return "https" if self.ssl_certfile else "http"

    def for_model(self, model: str) -> ServerArgs:
        """These arguments serving `model`: `model_name` (and `model_aliases`) from
        ``--served-model-name`` (a name or a list) or `model`, the API key from
        ``NEXTOKEN_API_KEY`` when none is given."""
        names = [self.served_model_name] if isinstance(self.served_model_name, str) else list(self.served_model_name)
        return replace(self, model_name=names[0] if names else model, model_aliases=tuple(names[1:]),
                       api_key=self.api_key or os.environ.get("NEXTOKEN_API_KEY") or None)
