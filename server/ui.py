"""The built-in chat page: GET / (static HTML + JS + CSS from server/static, no build step).

The page and its assets are public even with --api-key (a browser cannot attach a key to a
page load, and the files hold no data); every API call the page makes sends the key typed into
its settings.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from starlette.responses import FileResponse
from starlette.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"

router = APIRouter()


@router.get("/", include_in_schema=False)
async def chat_page() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html")


def static_files() -> StaticFiles:
    return StaticFiles(directory=STATIC_DIR)
