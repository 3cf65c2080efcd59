"""The status page's files (``GET /ui``): plain HTML, CSS and JavaScript, shipped in the wheel.

No build step and nothing from outside the gateway: the page works offline.
Its data comes from ``GET /events`` (``proxy.status``) and its buttons call
the admin routes, with the API key the page asks for once and keeps in the
browser's session storage.

Every file goes out with a policy that lets the page run only its own files,
talk only to the gateway and be framed by no one (clickjacking): a page
elsewhere cannot put its buttons under a visitor's pointer.
"""

from __future__ import annotations

from importlib import resources

from starlette.responses import Response

from proxy.errors import echo, error_body

_TYPES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
}

HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}

# Read once: the files do not change while the gateway runs.
_files: dict[str, bytes] = {}


def response(name: str) -> Response:
    """One of the page's files, with its type and the page's policy; 404 for any other name."""
    media_type = _TYPES.get(name)
    if media_type is None:
        body = error_body(404, f"the status page has no file {echo(name)!r}", code="unknown_url")
        return Response(body, status_code=404, media_type="application/json")
    data = _files.get(name)
    if data is None:
        data = _files[name] = resources.files(__package__).joinpath(name).read_bytes()
    return Response(data, media_type=media_type, headers=HEADERS)
