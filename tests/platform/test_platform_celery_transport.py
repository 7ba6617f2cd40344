"""The embedded broker never hands a consumer a message that is still being written."""

import threading

from kombu import Connection, Exchange, Queue

from controlplane.common.celery_filesystem import Transport

MESSAGES = 300


def _connection(folder) -> Connection:
    options = {
        "data_folder_in": str(folder / "queue"),
        "data_folder_out": str(folder / "queue"),
        "control_folder": str(folder / "control"),
        "polling_interval": 0.001,
    }
    for sub in ("queue", "control"):
        (folder / sub).mkdir(exist_ok=True)
    return Connection(transport=Transport, transport_options=options)


def test_a_consumer_polling_while_messages_are_written_gets_every_one_whole(tmp_path):
    queue = Queue("jobs", Exchange("jobs"), routing_key="jobs")
    received = []
    with _connection(tmp_path) as producer_connection, _connection(tmp_path) as consumer_connection:
        consumer = consumer_connection.SimpleQueue(queue)
        producer = producer_connection.SimpleQueue(queue)

        def produce():
            for number in range(MESSAGES):
                producer.put({"number": number, "padding": "x" * 4096})

        writer = threading.Thread(target=produce)
        writer.start()
        while len(received) < MESSAGES:
            message = consumer.get(timeout=10)
            received.append(message.payload["number"])
            message.ack()
        writer.join()
    assert sorted(received) == list(range(MESSAGES))
    assert [path.name for path in (tmp_path / "queue").iterdir()] == []
