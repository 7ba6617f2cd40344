"""The KV hand-off's clocks are made in one place, and a set whose waits would not nest is refused when it
is made: a sender that gave up on the hello's answer before the receiver stopped waiting for the decode
request would turn every late registration into the sender's unclear timeout."""

import pytest

from workers.kv_connector.timeouts import KvTimeouts


def test_the_defaults_nest():
    timeouts = KvTimeouts()
    assert timeouts.arrival_s < timeouts.hello_answer_s < timeouts.kv_wait_s


@pytest.mark.parametrize(
    ("clocks", "refusal"),
    [
        ({"arrival_s": 10.0}, "must outlast the receiver's wait for the decode request"),
        ({"hello_answer_s": 40.0}, "the decode call's wait for its KV"),
        ({"io_s": 0.0}, "io_s must be above 0"),
        ({"endpoint_s": -1.0}, "endpoint_s must be above 0"),
    ],
)
def test_waits_that_do_not_nest_are_refused_when_made(clocks, refusal):
    with pytest.raises(ValueError, match=refusal):
        KvTimeouts(**clocks)
