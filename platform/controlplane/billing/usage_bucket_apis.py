"""OpenAI's organization usage and costs endpoints, in its shapes: /api/v1/organization/usage/completions and
/api/v1/organization/costs (the gateway serves them at /v1/organization/...)."""

import time

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.billing.usage_buckets import (
    BUCKET_SECONDS,
    COST_GROUP_FIELDS,
    USAGE_GROUP_FIELDS,
    bucket_page,
    completions_usage,
    costs,
)
from controlplane.common.filters import QueryFilterSerializer
from controlplane.tenancy.access import Permission
from controlplane.tenancy.base_apis import TenantAPIView

# Buckets per page by width, as OpenAI allows them: (default, most).
USAGE_BUCKET_LIMITS = {"1d": (7, 31), "1h": (24, 168), "1m": (60, 1440)}
COST_BUCKET_LIMITS = {"1d": (7, 180)}
MAX_UNIX_SECONDS = 253_402_300_799  # 9999-12-31T23:59:59Z


def _query_data(request: Request, list_fields: tuple[str, ...]) -> dict:
    """The query as a dict: lists for `list_fields`, given repeated (`models=a&models=b`) or with brackets
    (`models[]=a`, as OpenAI's clients send them)."""
    data: dict = {}
    for name in request.query_params:
        field = name.removesuffix("[]")
        values = request.query_params.getlist(name)
        if field in list_fields:
            data.setdefault(field, []).extend(values)
        else:
            data[field] = values[-1]
    return data


def _bracket_parameters(list_fields: tuple[str, ...]) -> list[OpenApiParameter]:
    return [
        OpenApiParameter(
            f"{name}[]", str, OpenApiParameter.QUERY, many=True, description=f"`{name}`, as OpenAI's clients send it."
        )
        for name in list_fields
    ]


USAGE_LIST_FIELDS = ("group_by", "project_ids", "api_key_ids", "models")
COST_LIST_FIELDS = ("group_by", "project_ids", "api_key_ids", "line_items")


class BucketQuerySerializer(QueryFilterSerializer):
    bucket_limits: dict[str, tuple[int, int]] = USAGE_BUCKET_LIMITS

    start_time = serializers.IntegerField(min_value=0, max_value=MAX_UNIX_SECONDS, help_text="Unix seconds, inclusive.")
    end_time = serializers.IntegerField(
        min_value=0, max_value=MAX_UNIX_SECONDS, required=False, help_text="Unix seconds, exclusive; default now."
    )
    limit = serializers.IntegerField(min_value=1, required=False, help_text="Buckets per page.")
    page = serializers.CharField(max_length=20, required=False, help_text="The previous answer's next_page.")
    project_ids = serializers.ListField(child=serializers.CharField(max_length=64), required=False, max_length=100)
    api_key_ids = serializers.ListField(child=serializers.CharField(max_length=64), required=False, max_length=100)

    def validate(self, attrs: dict) -> dict:
        default, most = self.bucket_limits[attrs["bucket_width"]]
        attrs.setdefault("limit", default)
        if attrs["limit"] > most:
            raise serializers.ValidationError({"limit": [f"At most {most} with bucket_width={attrs['bucket_width']}."]})
        attrs.setdefault("end_time", int(time.time()))
        if attrs["end_time"] <= attrs["start_time"]:
            raise serializers.ValidationError({"end_time": ["Must be after start_time."]})
        return attrs


class UsageQuerySerializer(BucketQuerySerializer):
    bucket_width = serializers.ChoiceField(choices=list(USAGE_BUCKET_LIMITS), default="1d")
    group_by = serializers.ListField(child=serializers.ChoiceField(choices=list(USAGE_GROUP_FIELDS)), required=False)
    models = serializers.ListField(child=serializers.CharField(max_length=200), required=False, max_length=100)
    batch = serializers.BooleanField(required=False, allow_null=True, default=None)


class CostsQuerySerializer(BucketQuerySerializer):
    bucket_limits = COST_BUCKET_LIMITS

    bucket_width = serializers.ChoiceField(choices=list(COST_BUCKET_LIMITS), default="1d")
    group_by = serializers.ListField(child=serializers.ChoiceField(choices=list(COST_GROUP_FIELDS)), required=False)
    line_items = serializers.ListField(child=serializers.CharField(max_length=300), required=False, max_length=100)


class UsageResultSerializer(serializers.Serializer):
    object = serializers.ChoiceField(choices=["organization.usage.completions.result"])
    input_tokens = serializers.IntegerField(help_text="Prompt tokens, cached ones included.")
    output_tokens = serializers.IntegerField()
    input_cached_tokens = serializers.IntegerField()
    input_uncached_tokens = serializers.IntegerField()
    input_audio_tokens = serializers.IntegerField()
    output_audio_tokens = serializers.IntegerField()
    num_model_requests = serializers.IntegerField()
    project_id = serializers.CharField(allow_null=True)
    api_key_id = serializers.CharField(allow_null=True)
    model = serializers.CharField(allow_null=True)
    batch = serializers.BooleanField(allow_null=True)
    user_id = serializers.CharField(allow_null=True)
    service_tier = serializers.CharField(allow_null=True)


class CostResultSerializer(serializers.Serializer):
    class AmountSerializer(serializers.Serializer):
        value = serializers.FloatField(help_text="Dollars.")
        currency = serializers.ChoiceField(choices=["usd"])

    object = serializers.ChoiceField(choices=["organization.costs.result"])
    amount = AmountSerializer()
    line_item = serializers.CharField(allow_null=True)
    project_id = serializers.CharField(allow_null=True)
    api_key_id = serializers.CharField(allow_null=True)


def _page_serializer(result_serializer: type[serializers.Serializer], name: str) -> type[serializers.Serializer]:
    bucket = type(
        f"{name}BucketSerializer",
        (serializers.Serializer,),
        {
            "object": serializers.ChoiceField(choices=["bucket"]),
            "start_time": serializers.IntegerField(),
            "end_time": serializers.IntegerField(),
            "results": result_serializer(many=True),
        },
    )
    return type(
        f"{name}PageSerializer",
        (serializers.Serializer,),
        {
            "object": serializers.ChoiceField(choices=["page"]),
            "data": bucket(many=True),
            "has_more": serializers.BooleanField(),
            "next_page": serializers.CharField(allow_null=True),
        },
    )


UsagePageSerializer = _page_serializer(UsageResultSerializer, "UsageCompletions")
CostsPageSerializer = _page_serializer(CostResultSerializer, "Costs")


def _answer(buckets: list[dict], next_page: str | None) -> dict:
    return {"object": "page", "data": buckets, "has_more": next_page is not None, "next_page": next_page}


class OrganizationUsageCompletionsApi(TenantAPIView):
    required_permissions = {"GET": Permission.USAGE_READ}
    list_fields = USAGE_LIST_FIELDS

    @extend_schema(
        parameters=[UsageQuerySerializer, *_bracket_parameters(USAGE_LIST_FIELDS)], responses=UsagePageSerializer
    )
    def get(self, request: Request) -> Response:
        query = UsageQuerySerializer(data=_query_data(request, self.list_fields))
        query.is_valid(raise_exception=True)
        fields = dict(query.validated_data)
        width, limit, cursor = fields["bucket_width"], fields.pop("limit"), fields.pop("page", None)
        page = bucket_page(
            start_time=fields["start_time"], end_time=fields["end_time"], width_s=BUCKET_SECONDS[width], limit=limit,
            page=cursor,
        )  # fmt: skip
        buckets = completions_usage(organization=self.organization, page=page, **fields)
        return Response(UsagePageSerializer(_answer(buckets, page.next_page)).data)


class OrganizationCostsApi(TenantAPIView):
    required_permissions = {"GET": Permission.BILLING_READ}
    list_fields = COST_LIST_FIELDS

    @extend_schema(
        parameters=[CostsQuerySerializer, *_bracket_parameters(COST_LIST_FIELDS)], responses=CostsPageSerializer
    )
    def get(self, request: Request) -> Response:
        """Costs per UTC day from the daily usage rollup (what usage/daily and the invoices read)."""
        query = CostsQuerySerializer(data=_query_data(request, self.list_fields))
        query.is_valid(raise_exception=True)
        fields = dict(query.validated_data)
        page = bucket_page(
            start_time=fields.pop("start_time"), end_time=fields.pop("end_time"), width_s=BUCKET_SECONDS["1d"],
            limit=fields.pop("limit"), page=fields.pop("page", None),
        )  # fmt: skip
        del fields["bucket_width"]
        return Response(
            CostsPageSerializer(
                _answer(costs(organization=self.organization, page=page, **fields), page.next_page)
            ).data
        )
