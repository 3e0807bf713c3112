"""The JSON bodies of the RL routes (rl_routes.py), as pydantic models for the OpenAPI
document (openapi.py).

rl_routes.py reads these bodies field by field, as vLLM does, so that its messages
name exactly the field at fault (`init_info.master_port`); these models state the
same fields and types for clients and fuzzers. Unknown fields are ignored there too.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

Port = Annotated[int, Field(ge=0, le=65535)]
Count = Annotated[int, Field(ge=0)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class InitInfo(_Body):
    master_address: Annotated[str, Field(min_length=1)]
    master_port: Port
    rank_offset: Count
    world_size: Count
    timeout_s: Annotated[float, Field(gt=0)] | None = None


class InitWeightTransferBody(_Body):
    """POST /init_weight_transfer_engine."""

    init_info: InitInfo


class StartWeightUpdateBody(_Body):
    """POST /start_weight_update (the flag is accepted and ignored)."""

    is_checkpoint_format: bool | None = None


class UpdateInfo(_Body):
    names: list[str] | None = None
    dtype_names: list[str] | None = None
    shapes: list[list[Count]] | None = None
    shared_memory_path: str | None = None
    offsets: list[Any] | None = None


class UpdateWeightsBody(_Body):
    """POST /update_weights."""

    update_info: UpdateInfo


class FinishWeightUpdateBody(_Body):
    """POST /finish_weight_update."""

    weight_version: str | None = None


class UpdateWeightsFromDiskBody(_Body):
    """POST /update_weights_from_disk (SGLang's)."""

    model_path: Annotated[str, Field(min_length=1)]
    weight_version: str | None = None
