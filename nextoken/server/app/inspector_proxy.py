"""``/inspect`` on a server whose engine runs in a process of its own: every request under it is
forwarded to the inspector that process serves on a Unix socket (`server.app.inspector_host`), and its answer
streamed back as it comes (the live views are event streams). The server's own checks (the API
key, loading) run first, as for any route; the inspector's app checks the key again."""

from __future__ import annotations

import logging

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

# hop-by-hop and recomputed headers: not forwarded either way
DROP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


class _QuietForwards(logging.Filter):
    """httpx logs each request at INFO: not the forwarded ones (uvicorn's access log is off too)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "http://inspector/" not in record.getMessage()


async def _body(answer: httpx.Response):
    """The answer's bytes as they come; the end of the stream if the engine process goes away
    mid-answer (the server then exits, its engine gone)."""
    try:
        async for chunk in answer.aiter_raw():
            yield chunk
    except httpx.TransportError:
        return


def install_proxy(app, path: str) -> None:
    """Forward ``/inspect`` and ``/inspect/...`` of `app` to the inspector on the Unix socket `path`."""
    logging.getLogger("httpx").addFilter(_QuietForwards())
    client = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=path), base_url="http://inspector",
                               timeout=httpx.Timeout(600.0, connect=5.0))
    router = APIRouter()

    async def forward(request: Request, rest: str = ""):
        url = "/inspect" + (f"/{rest}" if rest else "")
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in DROP]
        upstream = client.build_request(request.method, url, params=request.query_params, headers=headers,
                                        content=await request.body())
        try:
            answer = await client.send(upstream, stream=True)
        except httpx.TransportError as exc:
            return JSONResponse({"error": {"message": f"the inspector in the engine process did not answer ({exc})",
                                           "type": "server_error", "param": None, "code": 502}}, status_code=502)
        kept = {k: v for k, v in answer.headers.items() if k.lower() not in DROP}
        return StreamingResponse(_body(answer), status_code=answer.status_code, headers=kept,
                                 background=BackgroundTask(answer.aclose))

    for route in ("/inspect", "/inspect/{rest:path}"):
        router.add_api_route(route, forward, methods=["GET", "POST", "PUT", "DELETE"], include_in_schema=False)
    app.include_router(router)
    app.state.inspector_client = client
