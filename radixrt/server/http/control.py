"""The gateway's routes of the control ops declared with a `route` (`protocol.CONTROL_OPS`):
`/<op>`, SGLang's routes of a rollout engine (docs/rl.md: `/update_weights_from_disk`,
`/init_weights_update_group`, `/pause_generation`, ...) and of its LoRA adapters. Each forwards
its op with the caller's key (an admin op needs the admin's when keys are set). A body is the
op's fields as JSON, validated by a model made from the op's declaration (a field it does not
declare is refused by name, a wrong type is a 400 before anything is sent; a body of an op
whose fields all have defaults may be left out), and the answer takes the declared shape
(`HttpReply`)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, get_type_hints

from fastapi import FastAPI, Request
from pydantic import BaseModel, create_model

from radixrt.protocol import CONTROL_OPS, ControlOp
from radixrt.server.http.errors import APIError
from radixrt.server.http.schemas import Body

CONTROL_ROUTES = tuple(f"/{r.op}" for r in CONTROL_OPS.values() if r.route is not None)

Call = Callable[[Request, ControlOp], Awaitable[Any]]  # NativeAPI.control


def body_model(record: type[ControlOp]) -> type[BaseModel]:
    """The JSON body of `record`'s route: its fields, their types and defaults."""
    hints = get_type_hints(record, include_extras=True)
    fields: dict[str, Any] = {
        f.name: (hints[f.name], ... if f.default is dataclasses.MISSING else f.default)
        for f in dataclasses.fields(record)
    }
    return create_model(f"{record.__name__}Body", __base__=Body, **fields)


def add_control_routes(app: FastAPI, call: Call) -> None:
    for record in CONTROL_OPS.values():
        if record.route is not None:
            _add_route(app, call, record)


def _add_route(app: FastAPI, call: Call, record: type[ControlOp]) -> None:
    route = record.route
    assert route is not None
    model = body_model(record)
    optional = all(f.default is not dataclasses.MISSING for f in dataclasses.fields(record))

    async def control(request: Request, body: BaseModel | None = None) -> Any:
        fields = body.model_dump(exclude_none=True) if body is not None else {}
        try:
            op = record.from_wire(fields)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return route.reply.answer(await call(request, op))

    # FastAPI reads the body's model from the signature: the op's, required unless every
    # field has a default; a GET takes none
    params = [
        inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Request)
    ]
    if route.method == "POST":
        params.append(
            inspect.Parameter(
                "body",
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
                annotation=model | None if optional else model,
                default=None if optional else inspect.Parameter.empty,
            )
        )
    control.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    control.__name__ = record.op
    app.add_api_route(f"/{record.op}", control, methods=[route.method])
