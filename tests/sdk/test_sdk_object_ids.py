"""An id that names an object in a request's path is checked before anything is sent, by every resource
alike: an empty id would otherwise reach another endpoint (`/v1/batches/` is the list) and a non-string
one would be sent as its repr. The clients point at a listener that counts the connections it gets."""

import socket

import pytest

import diptych


@pytest.fixture
def listener():
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    yield server
    server.close()


def connections(server: socket.socket) -> int:
    count = 0
    while True:
        try:
            accepted, _ = server.accept()
        except BlockingIOError:
            return count
        accepted.close()
        count += 1


def calls(client: diptych.Client, object_id):
    return [
        lambda: client.files.retrieve(object_id),
        lambda: client.files.content(object_id),
        lambda: client.files.delete(object_id),
        lambda: client.batches.retrieve(object_id),
        lambda: client.batches.cancel(object_id),
        lambda: client.responses.retrieve(object_id),
        lambda: client.responses.delete(object_id),
        lambda: client.responses.cancel(object_id),
        lambda: client.admin.api_keys.retrieve(object_id),
        lambda: client.admin.invoices.retrieve(object_id),
        lambda: client.admin.limits.retrieve_key(object_id),
    ]


@pytest.mark.parametrize("object_id", ["", None, 7])
def test_every_resource_refuses_an_id_that_names_nothing_before_sending(listener, object_id, monkeypatch):
    monkeypatch.delenv("DIPTYCH_HTTP_URL", raising=False)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    with diptych.Client(api_key="dk_test", http_url=url, admin_url=url, max_retries=0, timeout=1.0) as client:
        for call in calls(client, object_id):
            with pytest.raises(ValueError, match="expected a non-empty id"):
                call()
    assert connections(listener) == 0
