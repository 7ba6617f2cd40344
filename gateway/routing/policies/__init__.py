"""The routing policies by the name `--routing-policy` takes; a new policy is a module here and a line below."""

from collections.abc import Callable

from gateway.routing.policies.base import RoutingPolicy
from gateway.routing.policies.cache_aware import CacheAware
from gateway.routing.policies.power_of_two import PowerOfTwo

POLICIES: dict[str, Callable[[], RoutingPolicy]] = {"cache_aware": CacheAware, "power_of_two": PowerOfTwo}
DEFAULT_POLICY = "cache_aware"
