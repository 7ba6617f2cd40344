"""Django settings of the control plane, read from the environment.

Embedded mode (no DATABASE_URL, no CELERY_BROKER_URL) keeps all state under DIPTYCH_STATE_DIR
(default `.diptych/` at the repository root): a SQLite database and a filesystem Celery broker, so one
command runs everything.
"""

import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

REPO_ROOT = Path(__file__).resolve().parents[2]
STATE_DIR = Path(os.environ.get("DIPTYCH_STATE_DIR") or REPO_ROOT / ".diptych")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be an integer, got {raw!r}.") from None


def rate_limit_from_env(name: str, default: int) -> int | None:
    """A per-minute limit: a whole number from 0 to 2**31 - 1, or `unlimited` (None)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if raw == "unlimited":
        return None
    if not re.fullmatch(r"[0-9]{1,10}", raw) or int(raw) > 2**31 - 1:
        raise ImproperlyConfigured(f"{name} must be a whole number up to {2**31 - 1} or 'unlimited', got {raw!r}.")
    return int(raw)


def _env_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


def _restrict_mode(path: Path, mode: int) -> None:
    """Tightens `path` to `mode` when this user owns it (a path owned by someone else is theirs to set)."""
    if path.exists() and path.stat().st_uid == os.getuid() and path.stat().st_mode & 0o777 != mode:
        path.chmod(mode)


def _private_sqlite_database(path: Path) -> Path:
    """Creates the state directory (0700) and the database file (0600) before SQLite opens it: SQLite
    would create the file under the umask, usually readable by everyone, and it gives the -wal and -shm
    files it creates later the mode of the database file."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    _restrict_mode(path.parent, 0o700)
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    for file in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        _restrict_mode(file, 0o600)
    return path


DEBUG = _env_flag("DIPTYCH_DEBUG")
EMBEDDED = not os.environ.get("DATABASE_URL")

_INSECURE_SECRET_KEY = "django-insecure-diptych-embedded-only-never-use-in-production"
SECRET_KEY = os.environ.get("DIPTYCH_SECRET_KEY") or (_INSECURE_SECRET_KEY if DEBUG or EMBEDDED else "")
if not SECRET_KEY:
    raise ImproperlyConfigured("DIPTYCH_SECRET_KEY must be set when DATABASE_URL is set (production mode).")

ALLOWED_HOSTS = _env_list("DIPTYCH_ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]"])

# Shared secret of the gateway for the internal endpoints; empty means they refuse every call.
DIPTYCH_INTERNAL_TOKEN = os.environ.get("DIPTYCH_INTERNAL_TOKEN", "")
DIPTYCH_WORKER_DEAD_AFTER_SECONDS = _env_int("DIPTYCH_WORKER_DEAD_AFTER_SECONDS", 10)
DIPTYCH_HEARTBEAT_INTERVAL_SECONDS = _env_int("DIPTYCH_HEARTBEAT_INTERVAL_SECONDS", 2)

# The rate limits a new organization starts with (None: unlimited), like OpenAI's first usage tier for its
# small models (500 requests and 200,000 tokens a minute), here for input and output tokens each. An
# organization's admins change them with PATCH /api/v1/limits.
DIPTYCH_DEFAULT_RATE_LIMITS = {
    "requests_per_minute": rate_limit_from_env("DIPTYCH_DEFAULT_REQUESTS_PER_MINUTE", 500),
    "input_tokens_per_minute": rate_limit_from_env("DIPTYCH_DEFAULT_INPUT_TOKENS_PER_MINUTE", 200_000),
    "output_tokens_per_minute": rate_limit_from_env("DIPTYCH_DEFAULT_OUTPUT_TOKENS_PER_MINUTE", 200_000),
}

# Model artifacts (`diptych model register`): empty DIPTYCH_ARTIFACT_STORE keeps them in DIPTYCH_ARTIFACT_DIR,
# served to workers by the control plane; s3://BUCKET/PREFIX keeps them in S3-compatible storage (at
# DIPTYCH_ARTIFACT_S3_ENDPOINT, empty for AWS), with credentials from the usual AWS_* environment.
DIPTYCH_ARTIFACT_STORE = os.environ.get("DIPTYCH_ARTIFACT_STORE", "").strip()
DIPTYCH_ARTIFACT_DIR = Path(os.environ.get("DIPTYCH_ARTIFACT_DIR") or STATE_DIR / "artifacts")
DIPTYCH_ARTIFACT_S3_ENDPOINT = os.environ.get("DIPTYCH_ARTIFACT_S3_ENDPOINT", "").strip()

# Stripe: empty STRIPE_API_KEY keeps invoices as drafts here; STRIPE_API_BASE points the library at
# another server (a local stand-in in tests).
STRIPE_API_KEY = os.environ.get("STRIPE_API_KEY", "")
STRIPE_API_BASE = os.environ.get("STRIPE_API_BASE", "")
STRIPE_WEBHOOK_SECRET = os.environ.get("STRIPE_WEBHOOK_SECRET", "")
STRIPE_DAYS_UNTIL_DUE = _env_int("STRIPE_DAYS_UNTIL_DUE", 30)

# The Batch API: input files are bounded in bytes and requests; the runner sends each batch's lines to the
# gateway's OpenAI-compatible API (DIPTYCH_GATEWAY_URL, its `/v1` base), at most so many of a batch at once,
# so that interactive traffic keeps the workers' capacity.
DIPTYCH_GATEWAY_URL = os.environ.get("DIPTYCH_GATEWAY_URL", "http://127.0.0.1:8080/v1")
DIPTYCH_BATCH_FILE_MAX_BYTES = _env_int("DIPTYCH_BATCH_FILE_MAX_BYTES", 4 * 2**20)
DIPTYCH_BATCH_FILE_MAX_LINES = _env_int("DIPTYCH_BATCH_FILE_MAX_LINES", 10_000)
DIPTYCH_BATCH_MAX_CONCURRENT_LINES = _env_int("DIPTYCH_BATCH_MAX_CONCURRENT_LINES", 2)
DIPTYCH_BATCH_SLICE_SECONDS = _env_int("DIPTYCH_BATCH_SLICE_SECONDS", 20)
DIPTYCH_BATCH_LEASE_SECONDS = _env_int("DIPTYCH_BATCH_LEASE_SECONDS", 30)
DIPTYCH_BATCH_LINE_TIMEOUT_SECONDS = _env_int("DIPTYCH_BATCH_LINE_TIMEOUT_SECONDS", 600)
DIPTYCH_BATCH_RESUME_SECONDS = _env_int("DIPTYCH_BATCH_RESUME_SECONDS", 10)

# Webhooks: each event goes to every endpoint of its organization subscribed to it, in up to
# DIPTYCH_WEBHOOK_MAX_TRIES tries, the first at once, then after DIPTYCH_WEBHOOK_FIRST_RETRY_SECONDS, three
# times longer before each next one (90 s, 270 s, 810 s, 2430 s: the fifth try an hour after the first).
# A URL must be https (DIPTYCH_WEBHOOKS_ALLOW_HTTP=1: http too) and reach public addresses only: the networks
# in DIPTYCH_WEBHOOKS_ALLOWED_NETWORKS (CIDRs) are allowed besides, DIPTYCH_WEBHOOKS_ALLOW_PRIVATE=1 allows all.
DIPTYCH_WEBHOOK_MAX_TRIES = _env_int("DIPTYCH_WEBHOOK_MAX_TRIES", 5)
DIPTYCH_WEBHOOK_FIRST_RETRY_SECONDS: float = _env_int("DIPTYCH_WEBHOOK_FIRST_RETRY_SECONDS", 90)
DIPTYCH_WEBHOOK_TIMEOUT_SECONDS: float = _env_int("DIPTYCH_WEBHOOK_TIMEOUT_SECONDS", 10)
DIPTYCH_WEBHOOK_RESUME_SECONDS = _env_int("DIPTYCH_WEBHOOK_RESUME_SECONDS", 60)
DIPTYCH_WEBHOOKS_ALLOW_HTTP = _env_flag("DIPTYCH_WEBHOOKS_ALLOW_HTTP")
# The certificate authorities an https receiver's certificate must chain to: a PEM file (an operator's own CA
# for receivers inside its network); by default certifi's public roots.
DIPTYCH_WEBHOOKS_CA_BUNDLE = os.environ.get("DIPTYCH_WEBHOOKS_CA_BUNDLE", "")
DIPTYCH_WEBHOOKS_ALLOWED_NETWORKS = _env_list("DIPTYCH_WEBHOOKS_ALLOWED_NETWORKS", []) + (
    ["0.0.0.0/0", "::/0"] if _env_flag("DIPTYCH_WEBHOOKS_ALLOW_PRIVATE") else []
)
for _network in DIPTYCH_WEBHOOKS_ALLOWED_NETWORKS:
    try:
        ipaddress.ip_network(_network, strict=False)
    except ValueError:
        raise ImproperlyConfigured(
            f"DIPTYCH_WEBHOOKS_ALLOWED_NETWORKS holds {_network!r}, which is no network (e.g. 10.0.0.0/8)."
        ) from None

# Stored responses (/v1/responses, which the gateway serves) are kept this long after they were created, then
# deleted (purge-expired-responses, hourly).
DIPTYCH_RESPONSE_RETENTION_DAYS = _env_int("DIPTYCH_RESPONSE_RETENTION_DAYS", 30)

# Where the public API's Idempotency-Key records are kept: the store the gateway's inference keys use too.
DIPTYCH_IDEMPOTENCY_STORE = "controlplane.idempotency.services"

# Spend alerts go to the organization's owners by email (printed to stderr unless configured).
EMAIL_BACKEND = os.environ.get("DIPTYCH_EMAIL_BACKEND", "django.core.mail.backends.console.EmailBackend")
DEFAULT_FROM_EMAIL = os.environ.get("DIPTYCH_FROM_EMAIL", "billing@diptych.local")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "controlplane.tenancy",
    "controlplane.catalog",
    "controlplane.idempotency",
    "controlplane.metering",
    "controlplane.billing",
    "controlplane.webhooks",
    "controlplane.batches",
    "controlplane.responses",
    "controlplane.dashboard",
    "controlplane.internal",
]

MIDDLEWARE = [
    "controlplane.common.request_id.RequestIdMiddleware",
    "controlplane.common.body_limit.RequestBodyLimitMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "controlplane.common.query_parameters.UnknownQueryParameterMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

# The largest body any endpoint reads (413 above it, before parsing), but one that names its own limit
# (`max_body_bytes`: the model registration's files). The largest legitimate one is a
# usage batch of MAX_EVENTS_PER_BATCH (1000) events: about 1 KB each with every text field at its
# maximum length, up to about 7 KB if that text is non-ASCII escaped as \uXXXX.
DATA_UPLOAD_MAX_MEMORY_SIZE = 8 * 2**20
# `diptych model register` sends a model directory in one request, a part per file (and a field naming
# its path): a sharded checkpoint can hold a couple of hundred files.
DATA_UPLOAD_MAX_NUMBER_FILES = 500

ROOT_URLCONF = "controlplane.urls"
WSGI_APPLICATION = "controlplane.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# Gateway, workers and Celery write concurrently: WAL plus immediate transactions turn "database is
# locked" failures into short waits. A deferred transaction that reads and then writes (an idempotency
# claim) fails at once, without waiting, when another connection wrote in between.
SQLITE_OPTIONS: Mapping[str, object] = {
    "timeout": 20,
    "transaction_mode": "IMMEDIATE",
    "init_command": "PRAGMA journal_mode=WAL;",
}


def database_settings(database_url: str) -> dj_database_url.DBConfig:
    """The default database: DATABASE_URL's, else the embedded SQLite file in the state directory. Every
    SQLite database gets SQLITE_OPTIONS, under the options a `sqlite:///` URL names itself."""
    if database_url:
        database = dj_database_url.parse(database_url, conn_max_age=60)
    else:
        database = dj_database_url.DBConfig(
            ENGINE="django.db.backends.sqlite3", NAME=str(_private_sqlite_database(STATE_DIR / "controlplane.sqlite3"))
        )
    if database.get("ENGINE") == "django.db.backends.sqlite3":
        database["OPTIONS"] = {**SQLITE_OPTIONS, **database.get("OPTIONS", {})}
    return database


DATABASES: dict[str, dj_database_url.DBConfig] = {"default": database_settings(os.environ.get("DATABASE_URL", ""))}

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = STATE_DIR / "static"

# The cache holds the sign-in throttle's counts: in Redis when REDIS_URL is set (the gateway's Redis; every
# control-plane process then counts together), else in each process's own memory.
REDIS_URL = os.environ.get("REDIS_URL", "").strip()
CACHES = {
    "default": (
        {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL, "KEY_PREFIX": "diptych:cp"}
        if REDIS_URL
        else {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
    )
}

# Failed sign-ins (a wrong password, a wrong invitation token) a client address may make a minute; past them
# every sign-in from it answers 429 until the minute is up.
DIPTYCH_SIGN_IN_FAILURES_PER_MINUTE = _env_int("DIPTYCH_SIGN_IN_FAILURES_PER_MINUTE", 10)
if DIPTYCH_SIGN_IN_FAILURES_PER_MINUTE < 1:
    raise ImproperlyConfigured("DIPTYCH_SIGN_IN_FAILURES_PER_MINUTE must be at least 1.")
# How many reverse proxies in front of the control plane append the client's address to X-Forwarded-For; the
# throttle counts per the address the first of them saw. 0 (the default) trusts none and counts per the
# connection's address, as a client must not choose its own.
DIPTYCH_TRUSTED_PROXIES = _env_int("DIPTYCH_TRUSTED_PROXIES", 0)

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["controlplane.tenancy.authentication.ApiKeyAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["controlplane.common.parsers.BoundedJSONParser"],
    "DEFAULT_PAGINATION_CLASS": "controlplane.common.pagination.DefaultPagination",
    "EXCEPTION_HANDLER": "controlplane.common.exception_handler.api_exception_handler",
    "DEFAULT_SCHEMA_CLASS": "controlplane.common.openapi.AutoSchema",
    "TEST_REQUEST_DEFAULT_FORMAT": "json",
    "DEFAULT_THROTTLE_RATES": {"sign_in_failure": f"{DIPTYCH_SIGN_IN_FAILURES_PER_MINUTE}/min"},
    "NUM_PROXIES": DIPTYCH_TRUSTED_PROXIES,
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Diptych control plane API",
    "DESCRIPTION": "Tenants, members, API keys, model catalog and prices, worker fleets, per-phase metering, "
    "usage, billing and invoices.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    # Request bodies get their own components, so required text fields are documented as non-empty,
    # and PATCH bodies are documented with the fields they require.
    "COMPONENT_SPLIT_REQUEST": True,
    "COMPONENT_SPLIT_PATCH": False,
    "ENUM_NAME_OVERRIDES": {
        "LedgerPhaseEnum": "controlplane.metering.models.Phase",
        "BilledPhaseEnum": "controlplane.catalog.models.PricePhase",
        "WebhookEventTypeEnum": "controlplane.webhooks.models.EventType",
        "ProjectRoleEnum": "controlplane.tenancy.models.ProjectRole",
    },
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "controlplane.common.openapi.document_error_responses",
    ],
}

CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "filesystem://")
if CELERY_BROKER_URL == "filesystem://":
    CELERY_BROKER_TRANSPORT = "controlplane.common.celery_filesystem:Transport"
    _celery_queue_dir = STATE_DIR / "celery" / "queue"
    _celery_processed_dir = STATE_DIR / "celery" / "processed"
    _celery_control_dir = STATE_DIR / "celery" / "control"
    for _folder in (_celery_queue_dir, _celery_processed_dir, _celery_control_dir):
        _folder.mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_celery_queue_dir),
        "data_folder_out": str(_celery_queue_dir),
        "processed_folder": str(_celery_processed_dir),
        "control_folder": str(_celery_control_dir),
        # The default of 1 s would make every task wait about a second before a worker sees it.
        "polling_interval": 0.01,
    }
CELERY_TASK_IGNORE_RESULT = True
CELERY_TIMEZONE = TIME_ZONE
CELERY_BEAT_SCHEDULE = {
    "mark-silent-workers-dead": {
        "task": "controlplane.catalog.tasks.mark_silent_workers_dead",
        "schedule": 5.0,
    },
    # The spend the gateway enforces is as fresh as the last rollup.
    "roll-up-usage": {"task": "controlplane.billing.tasks.roll_up_usage", "schedule": 10.0},
    "close-billing-periods": {"task": "controlplane.billing.tasks.close_billing_periods", "schedule": 600.0},
    "sync-invoices-with-stripe": {"task": "controlplane.billing.tasks.sync_invoices_with_stripe", "schedule": 300.0},
    # Picks up batches whose runner stopped (a restarted worker, a lost task) once its lease ran out.
    "resume-batches": {
        "task": "controlplane.batches.tasks.resume_batches",
        "schedule": float(DIPTYCH_BATCH_RESUME_SECONDS),
    },
    "purge-idempotency-records": {
        "task": "controlplane.idempotency.tasks.purge_idempotency_records",
        "schedule": 3600.0,
    },
    "purge-expired-responses": {"task": "controlplane.responses.tasks.purge_expired_responses", "schedule": 3600.0},
    # Tries the deliveries whose try is overdue: its task was lost (a restarted worker) or never sent.
    "resume-webhook-deliveries": {
        "task": "controlplane.webhooks.tasks.resume_webhook_deliveries",
        "schedule": float(DIPTYCH_WEBHOOK_RESUME_SECONDS),
    },
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    # text or JSON lines, as DIPTYCH_LOG_FORMAT says, like the gateway's and the workers' (docs/observability.md)
    "handlers": {
        "stderr": {"()": "diptych_common.logs.handler_for", "format_name": os.environ.get("DIPTYCH_LOG_FORMAT", "text")}
    },
    "root": {"handlers": ["stderr"], "level": "WARNING"},
    "loggers": {"controlplane": {"level": "INFO"}},
}
