"""SGLang's native routes of a rollout engine for reinforcement learning (docs/rl.md):
`/update_weights_from_disk`, `/pause_generation`, `/continue_generation`,
`/release_memory_occupation`, `/resume_memory_occupation`, `/init_weights_update_group`,
`/update_weights_from_distributed`, `/destroy_weights_update_group` (the admin's key when keys
are set) and `/get_weight_version`. Each is the runtime's op of that name (`server/rollout.py`)
with the caller's key; `update_weights_from_tensor` is `rt.Engine`'s alone, as in SGLang."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal

from fastapi import FastAPI, Request

from radixrt.protocol import WEIGHT_UPDATE_WAIT_S
from radixrt.server.http.schemas import Body

ROLLOUT_ROUTES = (
    "/update_weights_from_disk",
    "/pause_generation",
    "/continue_generation",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/get_weight_version",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/destroy_weights_update_group",
)


class UpdateWeightsFromDiskRequest(Body):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None


class InitWeightsUpdateGroupRequest(Body):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "gloo"


class UpdateWeightsFromDistributedRequest(Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class DestroyWeightsUpdateGroupRequest(Body):
    group_name: str = "weight_update_group"


class PauseGenerationRequest(Body):
    mode: Literal["abort", "in_place"] = "abort"


class EmptyRequest(Body):
    pass


class MemoryOccupationRequest(Body):
    tags: list[Literal["kv_cache"]] | None = None


Call = Callable[..., Awaitable[Any]]  # NativeAPI._call: (request, op, wait_s, **fields)


def add_rollout_routes(app: FastAPI, call: Call) -> None:
    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(req: UpdateWeightsFromDiskRequest, request: Request) -> dict:
        fields = req.model_dump(exclude_none=True)
        done = await call(request, "update_weights_from_disk", WEIGHT_UPDATE_WAIT_S, **fields)
        return {**done, "message": f"serving weight version {done['weight_version']}"}

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(
        req: InitWeightsUpdateGroupRequest, request: Request
    ) -> dict:
        fields = req.model_dump()
        return await call(request, "init_weights_update_group", WEIGHT_UPDATE_WAIT_S, **fields)

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(
        req: UpdateWeightsFromDistributedRequest, request: Request
    ) -> dict:
        fields = req.model_dump(exclude_none=True)
        done = await call(
            request, "update_weights_from_distributed", WEIGHT_UPDATE_WAIT_S, **fields
        )
        return {**done, "message": f"serving weight version {done['weight_version']}"}

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(
        req: DestroyWeightsUpdateGroupRequest, request: Request
    ) -> dict:
        return await call(request, "destroy_weights_update_group", group_name=req.group_name)

    @app.post("/pause_generation")
    async def pause_generation(req: PauseGenerationRequest, request: Request) -> dict:
        return {"success": await call(request, "pause_generation", mode=req.mode)}

    @app.post("/continue_generation")
    async def continue_generation(request: Request, req: EmptyRequest | None = None) -> dict:
        return {"success": await call(request, "continue_generation")}

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(
        request: Request, req: MemoryOccupationRequest | None = None
    ) -> dict:
        return {"success": await call(request, "release_memory_occupation")}

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(
        request: Request, req: MemoryOccupationRequest | None = None
    ) -> dict:
        return {"success": await call(request, "resume_memory_occupation")}

    @app.get("/get_weight_version")
    async def get_weight_version(request: Request) -> dict:
        return await call(request, "get_weight_version")
