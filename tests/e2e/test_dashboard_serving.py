"""The control plane's dashboard view without a browser or a live stack (Django's test client)."""

from pathlib import Path


def test_missing_bundle_is_a_clear_503(client, settings, tmp_path):
    settings.DIPTYCH_DASHBOARD_DIST = tmp_path
    response = client.get("/dashboard/")
    assert response.status_code == 503
    assert "make install" in response.content.decode() and str(tmp_path / "index.html") in response.content.decode()


def test_bundle_is_served_with_caching_suited_to_each_file(client, settings, tmp_path):
    (tmp_path / "assets").mkdir()
    (tmp_path / "index.html").write_text('<script type="module" src="/dashboard/assets/app-1a2b.js"></script>')
    (tmp_path / "assets" / "app-1a2b.js").write_text("console.log('dashboard')")
    (tmp_path / "secret.txt").write_text("outside the assets folder")
    settings.DIPTYCH_DASHBOARD_DIST = tmp_path

    page = client.get("/dashboard/")
    assert page.status_code == 200 and page["Cache-Control"] == "no-cache"
    assert b"app-1a2b.js" in b"".join(page.streaming_content)
    assert "csrftoken" in page.cookies

    asset = client.get("/dashboard/assets/app-1a2b.js")
    assert asset.status_code == 200 and "immutable" in asset["Cache-Control"]
    assert client.get("/dashboard/assets/../secret.txt").status_code == 404
    assert client.get("/dashboard/assets/nothing.js").status_code == 404
    assert client.get("/dashboard").status_code == 301  # APPEND_SLASH
    assert Path(settings.DIPTYCH_DASHBOARD_DIST) == tmp_path
