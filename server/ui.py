"""The built-in chat page: GET / (static HTML + JS + CSS from server/static, no build step).

The page and its assets are public even with --api-key (a browser cannot attach a key to a
page load, and the files hold no data); every API call the page makes sends the key typed into
its settings. The page names its icon (/static/favicon.svg); GET /favicon.ico, which browsers
and other clients ask for on their own, answers with the same icon rather than a 404.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from starlette.responses import FileResponse
from starlette.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"
FAVICON = STATIC_DIR / "favicon.svg"

router = APIRouter()


@router.get("/", include_in_schema=False)
async def chat_page() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html")


@router.get("/favicon.ico", include_in_schema=False)
async def favicon() -> FileResponse:
    return FileResponse(FAVICON, media_type="image/svg+xml")


def static_files() -> StaticFiles:
    return StaticFiles(directory=STATIC_DIR)
