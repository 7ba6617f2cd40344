"""The environment file `diptych up` writes: every variable the SDK, an OpenAI client and the CLI read, and
only its owner may read it (it holds the demo API key and the internal API's token)."""

import stat

from diptych_server.up import write_env_file


def test_the_env_file_names_the_gateway_s_grpc_and_http_urls_the_control_plane_and_its_token(tmp_path):
    written = write_env_file(
        tmp_path,
        api_key="dk_demo",
        base_url="grpc://127.0.0.1:50051",
        http_url="http://127.0.0.1:8081/v1",
        control_plane_url="http://127.0.0.1:8000",
        internal_token="internal-token",
    )
    assert written == tmp_path / "env"
    variables = dict(line.split("=", 1) for line in written.read_text().splitlines())
    assert variables == {
        "DIPTYCH_API_KEY": "dk_demo",
        "DIPTYCH_BASE_URL": "grpc://127.0.0.1:50051",
        "DIPTYCH_HTTP_URL": "http://127.0.0.1:8081/v1",
        "DIPTYCH_ADMIN_URL": "http://127.0.0.1:8000",
        "DIPTYCH_CONTROL_PLANE_URL": "http://127.0.0.1:8000",
        "DIPTYCH_INTERNAL_TOKEN": "internal-token",
    }
    assert stat.S_IMODE(written.stat().st_mode) == 0o600
