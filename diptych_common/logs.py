"""Log lines of the gateway, workers and control plane: text or JSON lines (`DIPTYCH_LOG_FORMAT=json`,
or `diptych --log-format json`), each line about a request carrying its request id and trace id.

The ids live in context variables: `bind_request` sets them in the task serving the request (grpc.aio
and aiohttp run each call in a task of its own, so they never leak into another request), and a filter
copies them onto every record."""

import contextvars
import json
import logging
import os
import sys
from datetime import UTC, datetime
from typing import TextIO

LOG_FORMATS = ("text", "json")
_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("diptych_request_id", default="")
_trace_id: contextvars.ContextVar[str] = contextvars.ContextVar("diptych_trace_id", default="")
_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s%(request_suffix)s"


def bind_request(request_id: str, trace_id: str = "") -> None:
    """Names the request the current task serves, for every line it logs from now on."""
    _request_id.set(request_id)
    _trace_id.set(trace_id)


def describe_error(error: BaseException) -> str:
    """An error's type and message; the type alone says what happened when the message is empty (a bare
    TimeoutError)."""
    message = str(error)
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


class RequestContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        request_id = getattr(record, "request_id", "") or _request_id.get()
        trace_id = getattr(record, "trace_id", "") or _trace_id.get()
        ids = [f"{key}={value}" for key, value in (("request", request_id), ("trace", trace_id)) if value]
        record.__dict__.update(
            request_id=request_id, trace_id=trace_id, request_suffix=f" [{' '.join(ids)}]" if ids else ""
        )
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in ("request_id", "trace_id"):
            if value := getattr(record, key, ""):
                line[key] = value
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            line["error_type"] = type(error).__name__
            line["error_message"] = str(error)
            line["traceback"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def log_format(chosen: str | None = None) -> str:
    """The format asked for: the flag, else DIPTYCH_LOG_FORMAT, else text."""
    value = (chosen or os.environ.get("DIPTYCH_LOG_FORMAT", "") or "text").lower()
    if value not in LOG_FORMATS:
        raise ValueError(f"DIPTYCH_LOG_FORMAT / --log-format must be one of {', '.join(LOG_FORMATS)}, not {value!r}")
    return value


def handler_for(format_name: str, stream: TextIO | None = None) -> logging.Handler:
    """A stderr handler in `format_name` (checked as log_format checks it); Django's LOGGING builds one too."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format(format_name) == "json" else logging.Formatter(_TEXT))
    handler.addFilter(RequestContextFilter())
    return handler


def configure_logging(format_name: str | None = None, level: int = logging.INFO) -> None:
    """Replaces the root logger's handlers with one to stderr in the chosen format."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(handler_for(log_format(format_name)))
    root.setLevel(level)
