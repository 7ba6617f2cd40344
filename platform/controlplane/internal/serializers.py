"""Input shapes shared by more than one internal endpoint, or long enough to read on their own."""

from rest_framework import serializers

from controlplane.catalog.models import PriceTier
from controlplane.common.limits import MAX_BIG_INTEGER
from controlplane.metering.models import Phase, RefusalScope, RefusedLimit

EXECUTION_ID_PATTERN = r"^exec_[0-9a-f]{32}$"
CLIENT_REQUEST_ID_PATTERN = r"^[A-Za-z0-9_.:-]{0,128}$"


# host:port with a port from 1 to 65535, as a pattern so that the schema documents it exactly.
ADDRESS_PATTERN = r"^.+:0*([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])$"
ADDRESS_MESSAGE = "Expected 'host:port' with a port between 1 and 65535."


class LimitsSerializer(serializers.Serializer):
    """Per-minute limits the gateway enforces; null is unlimited."""

    requests_per_minute = serializers.IntegerField(allow_null=True)
    input_tokens_per_minute = serializers.IntegerField(allow_null=True)
    output_tokens_per_minute = serializers.IntegerField(allow_null=True)


class UsageEventSerializer(serializers.Serializer):
    """The HTTP translation of the internal API's `UsageEvent` message (diptych_common/internal_api/messages.py)."""

    request_id = serializers.CharField(max_length=128, help_text="The execution's server-issued id.")
    client_request_id = serializers.RegexField(CLIENT_REQUEST_ID_PATTERN, required=False, default="", allow_blank=True)
    phase = serializers.ChoiceField(choices=Phase.choices)
    organization_id = serializers.CharField(max_length=32)
    api_key_id = serializers.CharField(max_length=32)
    model = serializers.CharField(max_length=200)
    region = serializers.CharField(max_length=64)
    worker_id = serializers.CharField(max_length=64)
    tokens = serializers.IntegerField(min_value=0, max_value=MAX_BIG_INTEGER)
    cached_tokens = serializers.IntegerField(min_value=0, max_value=MAX_BIG_INTEGER)
    kv_bytes = serializers.IntegerField(min_value=0, max_value=MAX_BIG_INTEGER)
    compute_ms = serializers.IntegerField(min_value=0, max_value=MAX_BIG_INTEGER)
    started_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField()
    tier = serializers.ChoiceField(
        choices=PriceTier.choices, required=False, default=PriceTier.STANDARD, help_text="batch: a Batch API request."
    )

    def validate(self, attrs: dict) -> dict:
        if attrs["cached_tokens"] > attrs["tokens"]:
            raise serializers.ValidationError({"cached_tokens": ["Cannot exceed tokens."]})
        if attrs["started_at"] > attrs["finished_at"]:
            raise serializers.ValidationError({"finished_at": ["Cannot be before started_at."]})
        return attrs


class RefusalReportSerializer(serializers.Serializer):
    """A gateway's count of the requests one limit refused for one API key in one minute."""

    id = serializers.RegexField(
        r"^[A-Za-z0-9_-]{8,64}$", help_text="The gateway's id for this row: sent again, it counts once."
    )
    organization_id = serializers.CharField(max_length=32)
    api_key_id = serializers.CharField(max_length=32)
    scope = serializers.ChoiceField(choices=RefusalScope.choices)
    limit = serializers.ChoiceField(choices=RefusedLimit.choices)
    limit_value = serializers.IntegerField(min_value=0, max_value=MAX_BIG_INTEGER)
    minute = serializers.DateTimeField()
    refusals = serializers.IntegerField(min_value=1, max_value=2**31 - 1)


class IdempotencyKeyFields(serializers.Serializer):
    """What names one claim of an organization's idempotency key by one execution."""

    organization_id = serializers.CharField(max_length=32)
    key = serializers.CharField(max_length=255)
    execution_id = serializers.RegexField(EXECUTION_ID_PATTERN)


class ArtifactManifestSerializer(serializers.Serializer):
    """The contract of workers/ fetching a model's files: see `ArtifactManifestApi`."""

    class ArtifactFileSerializer(serializers.Serializer):
        path = serializers.CharField(help_text="Relative POSIX path inside the model directory.")
        size = serializers.IntegerField()
        sha256 = serializers.CharField()

    model = serializers.CharField()
    revision = serializers.CharField(help_text="Empty when the model is not published as artifacts.")
    source = serializers.CharField(help_text="`artifacts`, `builtin:<name>` or a local directory.")
    files = ArtifactFileSerializer(many=True)
    store = serializers.JSONField(
        allow_null=True,
        help_text='Where the files are: {"kind": "control-plane", "url"} or {"kind": "s3", "bucket", "prefix", '
        '"endpoint_url"}; null when there are no files to fetch.',
    )
