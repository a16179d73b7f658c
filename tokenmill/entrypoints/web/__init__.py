"""The web page at `/`: a chat playground and a live view of the engine (`tokenmill serve`,
off with `--no-web-ui`).

Three static files beside this module, served as they are: no build step, and nothing loaded
from another host, so the page works offline. The page talks to the server's own endpoints:
`/v1/models`, `/v1/chat/completions` (streamed) and `/stats/stream` (the engine view), sending
the API key it asks for when one is required. The page and its assets need no key: they hold
no data.
"""

from __future__ import annotations

from pathlib import Path

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route

WEB_DIR = Path(__file__).resolve().parent
ASSETS = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
_HEADERS = {"Cache-Control": "no-cache"}  # a new version of the server shows its own page


async def _index(request: Request) -> Response:
    return FileResponse(WEB_DIR / "index.html", media_type="text/html; charset=utf-8", headers=_HEADERS)


async def _asset(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in ASSETS:
        raise HTTPException(404, "Not Found")
    return FileResponse(WEB_DIR / name, media_type=ASSETS[name], headers=_HEADERS)


def web_routes() -> list[Route]:
    """`GET /` (the page) and `GET /web/{app.js,style.css}`; routes of a Starlette (or FastAPI) app."""
    return [Route("/", _index, methods=["GET"]), Route("/web/{name}", _asset, methods=["GET"])]
