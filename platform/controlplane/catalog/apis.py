from django.utils import timezone
from drf_spectacular.utils import extend_schema, extend_schema_field
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.catalog.models import PricePhase, PriceTier, WorkerState
from controlplane.catalog.selectors import (
    fleet_list,
    heartbeat_deadline,
    model_get,
    model_list,
    price_list,
    revision_files,
    worker_get,
    worker_list,
)
from controlplane.catalog.services import price_set, worker_drain
from controlplane.common.filters import QueryFilterSerializer
from controlplane.common.limits import MAX_BIG_INTEGER
from controlplane.common.pagination import PaginatedListMixin
from controlplane.tenancy.access import Permission
from controlplane.tenancy.base_apis import IsStaff, StaffAPIView, TenantAPIView


class ModelOutputSerializer(serializers.Serializer):
    name = serializers.CharField()
    family = serializers.CharField()
    source = serializers.CharField(
        help_text="`builtin:<name>`, the local directory of the weights, or `artifacts`: published files."
    )
    revision = serializers.CharField(
        source="published_revision", help_text="The published revision the workers load; empty when none."
    )
    context_length = serializers.IntegerField()
    dtype = serializers.CharField()
    tokenizer = serializers.CharField()
    fleets = serializers.SerializerMethodField(help_text="Names of the fleets that serve the model.")
    created_at = serializers.DateTimeField()

    def get_fleets(self, model) -> list[str]:
        return [fleet.name for fleet in model.fleets.all()]


class ModelFileOutputSerializer(serializers.Serializer):
    path = serializers.CharField()
    size = serializers.IntegerField()
    sha256 = serializers.CharField()


class ModelDetailOutputSerializer(ModelOutputSerializer):
    files = serializers.SerializerMethodField(help_text="The files of the current revision; empty when none.")

    @extend_schema_field(ModelFileOutputSerializer(many=True))
    def get_files(self, model) -> list[dict]:
        revision = model.published_revision
        files = revision_files(model=model, revision=revision) if revision else []
        return ModelFileOutputSerializer(files, many=True).data


class PriceOutputSerializer(serializers.Serializer):
    model = serializers.CharField(source="model.name")
    phase = serializers.ChoiceField(choices=PricePhase.choices)
    tier = serializers.ChoiceField(choices=PriceTier.choices)
    micros_per_million = serializers.IntegerField(help_text="Micro-dollars per million tokens.")
    effective_from = serializers.DateTimeField()
    created_at = serializers.DateTimeField()


class FleetOutputSerializer(serializers.Serializer):
    name = serializers.CharField()
    role = serializers.CharField()
    model = serializers.CharField(source="model.name")
    region = serializers.CharField()
    hardware_class = serializers.CharField()
    created_at = serializers.DateTimeField()


class WorkerOutputSerializer(serializers.Serializer):
    """A worker as staff see it, with its state as of now (a silent worker reads dead at once)."""

    id = serializers.CharField(source="public_id")
    name = serializers.CharField()
    fleet = serializers.CharField(source="fleet.name")
    role = serializers.CharField(source="fleet.role")
    model = serializers.CharField(source="fleet.model.name")
    region = serializers.CharField(source="fleet.region")
    hardware_class = serializers.CharField(source="fleet.hardware_class")
    address = serializers.CharField()
    state = serializers.SerializerMethodField()
    queue_depth = serializers.IntegerField()
    active_sequences = serializers.IntegerField()
    kv_blocks_free = serializers.IntegerField()
    kv_blocks_total = serializers.IntegerField()
    tokens_per_second = serializers.FloatField()
    registered_at = serializers.DateTimeField()
    last_heartbeat_at = serializers.DateTimeField()
    drain_requested_at = serializers.DateTimeField(allow_null=True)

    def get_state(self, worker) -> str:
        if worker.state != WorkerState.DEAD and worker.last_heartbeat_at < heartbeat_deadline(now=timezone.now()):
            return WorkerState.DEAD
        return worker.state


class ModelListApi(PaginatedListMixin, TenantAPIView):
    required_permissions = {"GET": Permission.CATALOG_READ}

    @extend_schema(responses=ModelOutputSerializer(many=True))
    def get(self, request: Request) -> Response:
        return self.paginated_response(queryset=model_list(), serializer_class=ModelOutputSerializer, request=request)


class ModelDetailApi(TenantAPIView):
    required_permissions = {"GET": Permission.CATALOG_READ}

    @extend_schema(responses=ModelDetailOutputSerializer)
    def get(self, request: Request, name: str) -> Response:
        return Response(ModelDetailOutputSerializer(model_get(name=name)).data)


class PriceListCreateApi(PaginatedListMixin, TenantAPIView):
    """Anyone in an organization reads the price book; only staff add prices."""

    required_permissions = {"GET": Permission.CATALOG_READ}

    class PriceFilterSerializer(QueryFilterSerializer):
        model = serializers.CharField(required=False, max_length=200)
        phase = serializers.ChoiceField(choices=PricePhase.choices, required=False)
        tier = serializers.ChoiceField(choices=PriceTier.choices, required=False)

    class PriceCreateInputSerializer(serializers.Serializer):
        model = serializers.CharField(max_length=200)
        phase = serializers.ChoiceField(choices=PricePhase.choices)
        tier = serializers.ChoiceField(choices=PriceTier.choices, default=PriceTier.STANDARD)
        micros_per_million = serializers.IntegerField(min_value=0, max_value=MAX_BIG_INTEGER)
        effective_from = serializers.DateTimeField(required=False, allow_null=True, default=None)

    def get_permissions(self):
        return [IsStaff()] if self.request.method == "POST" else super().get_permissions()

    @extend_schema(parameters=[PriceFilterSerializer], responses=PriceOutputSerializer(many=True))
    def get(self, request: Request) -> Response:
        filters = self.PriceFilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        return self.paginated_response(
            queryset=price_list(**filters.validated_data), serializer_class=PriceOutputSerializer, request=request
        )

    @extend_schema(request=PriceCreateInputSerializer, responses={201: PriceOutputSerializer})
    def post(self, request: Request) -> Response:
        serializer = self.PriceCreateInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        price = price_set(
            model=model_get(name=data["model"]),
            phase=data["phase"],
            tier=data["tier"],
            micros_per_million=data["micros_per_million"],
            effective_from=data["effective_from"],
            actor=self.principal,
        )
        return Response(PriceOutputSerializer(price).data, status=status.HTTP_201_CREATED)


class FleetListApi(PaginatedListMixin, StaffAPIView):
    @extend_schema(responses=FleetOutputSerializer(many=True))
    def get(self, request: Request) -> Response:
        return self.paginated_response(queryset=fleet_list(), serializer_class=FleetOutputSerializer, request=request)


class WorkerListApi(PaginatedListMixin, StaffAPIView):
    class WorkerFilterSerializer(QueryFilterSerializer):
        state = serializers.ChoiceField(choices=WorkerState.choices, required=False)
        fleet = serializers.CharField(required=False, max_length=100)

    @extend_schema(parameters=[WorkerFilterSerializer], responses=WorkerOutputSerializer(many=True))
    def get(self, request: Request) -> Response:
        filters = self.WorkerFilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        return self.paginated_response(
            queryset=worker_list(**filters.validated_data), serializer_class=WorkerOutputSerializer, request=request
        )


class WorkerDrainApi(StaffAPIView):
    @extend_schema(request=None, responses=WorkerOutputSerializer)
    def post(self, request: Request, worker_id: str) -> Response:
        worker = worker_drain(worker=worker_get(public_id=worker_id), actor=self.principal)
        return Response(WorkerOutputSerializer(worker).data)
