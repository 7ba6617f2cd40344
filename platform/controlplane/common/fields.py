"""Model fields shared by the apps."""

import json

from django.db import models


class JsonTextField(models.TextField):
    """A JSON value kept as its text. For values that hold model output or a client's strings: PostgreSQL's
    jsonb refuses the NUL character (``\\u0000``), which generated text can hold, while JSON text escapes
    it (and every other control character) so that the column never sees one."""

    def from_db_value(self, value, expression, connection):
        return None if value is None else json.loads(value)

    def to_python(self, value):
        return json.loads(value) if isinstance(value, str) else value

    def get_prep_value(self, value):
        return None if value is None else json.dumps(value, separators=(",", ":"))
