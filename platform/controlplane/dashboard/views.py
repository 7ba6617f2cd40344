"""Serves the dashboard's static bundle (frontend/dist, built by `make install` and CI).

The page talks to the public REST API with the session cookie; its first answer sets the CSRF cookie
that the page echoes in X-CSRFToken.
"""

from pathlib import Path

from django.conf import settings
from django.core.exceptions import SuspiciousFileOperation
from django.http import FileResponse, Http404, HttpRequest, HttpResponse
from django.views.decorators.csrf import ensure_csrf_cookie
from django.views.decorators.http import require_safe
from django.views.static import serve


def dist_dir() -> Path:
    return Path(getattr(settings, "DIPTYCH_DASHBOARD_DIST", settings.REPO_ROOT / "frontend" / "dist"))


@require_safe
@ensure_csrf_cookie
def index(request: HttpRequest) -> HttpResponse:
    page = dist_dir() / "index.html"
    if not page.is_file():
        return HttpResponse(
            f"The dashboard is not built ({page} is missing): run `make install`, "
            "or `npm ci && npm run build` in frontend/.\n",
            status=503,
            content_type="text/plain; charset=utf-8",
        )
    response = FileResponse(page.open("rb"), content_type="text/html; charset=utf-8")
    response["Cache-Control"] = "no-cache"
    return response


@require_safe
def asset(request: HttpRequest, path: str) -> HttpResponse:
    # Vite names assets by content hash, so a browser may keep them for good.
    try:
        response = serve(request, path, document_root=dist_dir() / "assets")
    except SuspiciousFileOperation:  # a path leading out of the assets folder
        raise Http404(f"No dashboard asset {path}") from None
    response["Cache-Control"] = "public, max-age=31536000, immutable"
    return response
