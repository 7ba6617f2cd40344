"""A method's keyword parameters, written once as a TypedDict for its overloads and its sync and async twins.

Type checkers read the TypedDict through `**params: Unpack[...]`. At run time the method's signature lists the
same parameters with their defaults, for `inspect.signature` and `help()`, and each call's arguments are
checked against it, as a written-out parameter list would check them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Generic, NotRequired, Required, TypeVar, cast, get_args, get_origin, get_type_hints

ParamsT = TypeVar("ParamsT", bound=Mapping[str, object])
MethodT = TypeVar("MethodT", bound=Callable[..., object])


class KeywordParameters(Generic[ParamsT]):
    """The keyword parameters that the TypedDict `params` describes. A parameter that is not required defaults
    to None, or to the value `defaults` gives it."""

    def __init__(self, params: type[ParamsT], **defaults: object) -> None:
        # The hints tell which keys are required: __required_keys__ is wrong under postponed annotations.
        hints = get_type_hints(params, include_extras=True)
        unknown = defaults.keys() - hints.keys()
        if unknown:
            raise TypeError(f"{params.__name__} has no parameter {', '.join(sorted(unknown))}")
        total = getattr(params, "__total__", True)
        parameters = [_parameter(name, hint, total, defaults) for name, hint in hints.items()]
        # the required ones first: a TypedDict that extends another lists the base's keys first
        parameters.sort(key=lambda parameter: parameter.default is not inspect.Parameter.empty)
        self._signature = inspect.Signature(parameters)

    def expand(self, method: MethodT) -> MethodT:
        """Shows the parameters in `method`'s signature in place of its `**params`."""
        own = inspect.signature(method, eval_str=True)
        kept = [parameter for parameter in own.parameters.values() if parameter.kind is not parameter.VAR_KEYWORD]
        signature = own.replace(parameters=[*kept, *self._signature.parameters.values()])
        method.__signature__ = signature  # type: ignore[attr-defined]  # inspect.signature reads it
        return method

    def complete(self, given: ParamsT) -> ParamsT:
        """The arguments of one call, with the defaults of those left out. A name that is not a parameter, or a
        required parameter left out, raises TypeError."""
        bound = self._signature.bind(**given)
        bound.apply_defaults()
        return cast(ParamsT, bound.arguments)


def _parameter(name: str, hint: object, total: bool, defaults: Mapping[str, object]) -> inspect.Parameter:
    qualifier = get_origin(hint)
    required = qualifier is Required or (total and qualifier is not NotRequired)
    annotation = get_args(hint)[0] if qualifier in (Required, NotRequired) else hint
    default = inspect.Parameter.empty if required else defaults.get(name)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
