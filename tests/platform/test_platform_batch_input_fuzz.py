"""A bounded fuzz of the Batch API's input files, the front door of batch lines: random lines (wrong types,
text that is not Unicode, line separators inside strings, deep nesting, bytes that are not UTF-8) through
upload and batch create. Whatever arrives, the answer is a success or a 400 in the API's error shape that
names the file or the line, nothing is stored for a refused file, and every line that is stored can be
sent as UTF-8: never a server error, never a line that would stop its batch."""

import json

from django.core.files.uploadedfile import SimpleUploadedFile
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from controlplane.batches.models import Batch, BatchLine, File

FILES = "/api/v1/files"
BATCHES = "/api/v1/batches"
CHAT = "/v1/chat/completions"

FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)

surrogates = st.sampled_from(["\ud800", "a\udfffb", "\ud83d", "x\udc00\ud800"])
separators = st.sampled_from(["\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\x1c", "\r"])
texts = st.one_of(
    st.text(max_size=12),
    st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=12),
    surrogates,
    st.tuples(st.text(max_size=6), separators, st.text(max_size=6)).map("".join),
)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False, allow_infinity=False), texts
)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3), max_leaves=10
)
nested = st.integers(1, 3_000).map(
    lambda depth: (
        f'{{"custom_id": "n", "method": "POST", "url": "{CHAT}", "body": {{"x": {"[" * depth}{"]" * depth}}}}}'
    )
)


def good_body(content: str = "Hi") -> dict:
    return {"model": "diptych-tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4}


def good_line(custom_id: str, content: str = "Hi") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": good_body(content)}


unicode_texts = st.one_of(
    st.text(alphabet=st.characters(codec="utf-8", exclude_categories=()), max_size=12),
    st.tuples(st.text(max_size=6), separators, st.text(max_size=6)).map("".join),
)


def mutated(line: dict, where: str, value) -> dict:
    """A good line with one part replaced by `value`."""
    if where in ("custom_id", "method", "url", "body"):
        return {**line, where: value}
    if where == "content":
        return {**line, "body": good_body(value)}
    if where == "parameter":
        key, item = value
        return {**line, "body": {**line["body"], key: item}}
    return {**line, where: value}  # a field a line does not have


mutations = st.one_of(
    st.tuples(st.sampled_from(["custom_id", "content"]), st.one_of(texts, json_values)),
    st.tuples(st.sampled_from(["method", "url", "body", "extra"]), json_values),
    st.tuples(st.just("parameter"), st.tuples(texts, json_values)),
)
bad_lines = st.builds(
    lambda index, mutation: mutated(good_line(f"line-{index}"), *mutation), st.integers(0, 9), mutations
)


def serialized(value, form: str) -> bytes:
    """One line as bytes: JSON with ASCII escapes (a surrogate stays an escape), or JSON as UTF-8 text (a
    surrogate becomes bytes that are not UTF-8)."""
    if form == "ascii":
        return json.dumps(value).encode()
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


forms = st.sampled_from(["ascii", "utf8"])
line_ends = st.sampled_from([b"\n", b"\r\n"])
rows = st.one_of(
    st.tuples(st.builds(good_line, st.uuids().map(str)), forms).map(lambda pair: serialized(*pair)),
    st.tuples(bad_lines, forms).map(lambda pair: serialized(*pair)),
    nested.map(str.encode),
    st.binary(max_size=24),
)
files = st.tuples(st.lists(rows, min_size=1, max_size=4), line_ends).map(lambda f: f[1].join(f[0]) + f[1])


def upload(client, content: bytes):
    return client.post(FILES, {"file": SimpleUploadedFile("in.jsonl", content), "purpose": "batch"}, format="multipart")


def assert_client_error(response) -> None:
    assert response.status_code == 400, (response.status_code, response.content[:500])
    error = response.json()["error"]
    assert error["type"] == "validation_error" and error["message"].startswith("Invalid batch input file: ")


@FUZZ
@given(content=files)
@example(content=serialized(good_line("\ud800"), "ascii") + b"\n")
@example(content=serialized(good_line("a", "\ud800"), "ascii") + b"\n")
@example(content=b"[" * 10_000 + b"]" * 10_000 + b"\n")
def test_any_input_file_is_stored_whole_or_refused_naming_what_is_wrong(client_a, tiny_model, content):
    files_before, batches_before = File.objects.count(), Batch.objects.count()
    uploaded = upload(client_a, content)
    if uploaded.status_code != 200:
        assert_client_error(uploaded)
        assert File.objects.count() == files_before
        return
    file = uploaded.json()
    created = client_a.post(
        BATCHES,
        {"input_file_id": file["id"], "endpoint": file_endpoint(file["id"]), "completion_window": "24h"},
        format="json",
    )
    if created.status_code != 200:
        assert_client_error(created)
        assert Batch.objects.count() == batches_before
        return
    for line in BatchLine.objects.filter(batch__public_id=created.json()["id"]):
        json.dumps({"custom_id": line.custom_id, "body": line.body}, ensure_ascii=False).encode("utf-8")


def file_endpoint(public_id: str) -> str:
    return File.objects.get(public_id=public_id).endpoint


@FUZZ
@given(
    contents=st.lists(unicode_texts, min_size=1, max_size=4),
    form=forms,
    end=line_ends,
)
@example(contents=["one\u2028two", "\x85\x1c\r"], form="utf8", end=b"\n")
def test_a_file_of_good_lines_holding_any_text_is_taken_whole(client_a, tiny_model, contents, form, end):
    """JSON Lines: every Unicode character inside a string is text, whatever str.splitlines makes of it."""
    sent = [good_line(f"line-{index}", content) for index, content in enumerate(contents)]
    uploaded = upload(client_a, end.join(serialized(line, form) for line in sent) + end)
    assert uploaded.status_code == 200, uploaded.json()
    created = client_a.post(
        BATCHES, {"input_file_id": uploaded.json()["id"], "endpoint": CHAT, "completion_window": "24h"}, format="json"
    )
    assert created.status_code == 200, created.json()
    stored = BatchLine.objects.filter(batch__public_id=created.json()["id"]).order_by("line_number")
    assert [(line.custom_id, line.body) for line in stored] == [(line["custom_id"], line["body"]) for line in sent]
