"""The ``route`` extension field of edge-serve's requests (docs/routing.md): ``"speculative"``, ``"cloud"``,
``"device"``, ``"cloud-first"`` or ``"auto"`` for this request; absent: the server's ``--route``. ``device``
answers with the draft's own tokens, unverified (the route report says so; OpenAI's response format has no field
for it)."""

from __future__ import annotations

from typing import Callable

from .errors import ApiError

__all__ = ["ROUTE_FIELD", "routed"]

ROUTE_FIELD = "route"


def routed(parse: Callable, body: dict, tokenizer):
    """``parse(body without route, tokenizer)`` (chat_request / completion_request) with the request's route in
    its generation kwargs.

    Raises:
        ApiError: 400 (param ``route``) for a value that is not a route; the parser's errors."""
    from specdec_runtime.edge_client.generation.routing import ROUTES

    body = dict(body)
    route = body.pop(ROUTE_FIELD, None)
    if route is not None and route not in ROUTES:
        raise ApiError(400, f"'route' must be one of {', '.join(ROUTES)}, got {route!r}", param=ROUTE_FIELD)
    req = parse(body, tokenizer)
    if route is not None:
        req.kwargs[ROUTE_FIELD] = route
    return req
