"""The frontend's gRPC server, wired: GenerateService (generate_service.py),
ChatService (chat/service.py), AdminService (admin.py) and vLLM's VllmEngine
(vllm_grpc/, unless --no-vllm-grpc) plus health and reflection,
the OpenAI-compatible HTTP API beside it (openai_api/), all on one request path
(pipeline.py) that routes over the engines a coordinator or a static list gives.

Shutdown (SIGTERM) drains: readiness turns NOT_SERVING and new generation calls get
UNAVAILABLE ("draining"); running ones may finish within the shutdown timeout,
then whatever is left ends with UNAVAILABLE ("shutting down") and the server stops.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid

import grpc
from corestream.generate.v1 import admin_service_pb2_grpc as admin_pb2_grpc
from corestream.generate.v1 import chat_service_pb2_grpc as chat_pb2_grpc
from corestream.generate.v1 import generate_service_pb2_grpc as generate_pb2_grpc
from corestream.generate.v1 import pooling_service_pb2_grpc as pooling_pb2_grpc
from corestream.vendor.smg_grpc_proto import vllm_engine_pb2_grpc as vllm_pb2_grpc

from services.common.auth import BearerAuthInterceptor, load_keys
from services.common.grpc_server import (
    AioHealth,
    add_aio_health_and_reflection,
    bind,
    host_port,
    server_options,
    start_aio_health_port,
)
from services.common.malformed import RejectMalformedInterceptor
from services.common.model_info import ModelInfo
from services.common.observability import Observability
from services.common.observability_config import ObservabilityConfig
from services.common.pooling import Pooler
from services.common.security_config import PLAINTEXT, SecurityConfig
from services.frontend import admin, generate_service
from services.frontend.chat import service as chat_service
from services.frontend.chat.answering import ChatAnswering
from services.frontend.chat.service import ChatServicer
from services.frontend.chat.template import ChatTemplates
from services.frontend.config import FrontendConfig
from services.frontend.generate_service import GenerateServicer
from services.frontend.model_server_metrics import (
    EngineCapacities,
    ServerLoadCollector,
    engine_loads,
)
from services.frontend.openai_api.app import HttpServer, HttpSettings, OpenAIApi
from services.frontend.openai_api.http_protocol import http_limits
from services.frontend.openai_api.sglang_routes import WorkerState
from services.frontend.pipeline import Pipeline
from services.frontend.pooling import service as pooling_service
from services.frontend.pooling.operations import PoolingOperations
from services.frontend.pooling.service import PoolingServicer
from services.frontend.routing.balancer import Balancer
from services.frontend.routing.engine_client import EngineClient
from services.frontend.routing.load_watcher import LoadWatcher
from services.frontend.routing.policies import RoutingPolicy
from services.frontend.routing.prefix_index import PrefixIndex
from services.frontend.tokenizer import TextTokenizer
from services.frontend.vllm_grpc import service as vllm_service
from services.frontend.vllm_grpc.kv_events import KvEventHub
from services.frontend.vllm_grpc.service import VllmEngineServicer
from services.frontend.weight_sync import WeightSync

log = logging.getLogger(__name__)

# After the drain, how long the aborted streams get to send their status.
_FINAL_GRACE_S = 2.0


class FrontendServer:
    """GenerateService, ChatService and AdminService plus health and reflection, fed by
    a coordinator or static engines."""

    def __init__(self, config: FrontendConfig, tokenizer: TextTokenizer, model: ModelInfo,
                 security: SecurityConfig = PLAINTEXT,
                 observability: Observability | None = None,
                 chat_templates: ChatTemplates | None = None,
                 pooler: Pooler | None = None) -> None:
        self._config = config
        self.observability = observability or Observability(
            "frontend", ObservabilityConfig(), config.host)
        self._security = security
        self._health_server: grpc.aio.Server | None = None
        self._frontend_id = f"frontend-{uuid.uuid4().hex[:12]}"
        policy = RoutingPolicy(config.routing_policy)
        # vLLM's SubscribeKvEvents relays the engines' cache events: with the API on,
        # every engine's Session subscribes to them.
        self.kv_events = KvEventHub() if config.vllm_grpc else None
        self.balancer = Balancer(
            self._frontend_id, on_readiness=self._on_readiness,
            client_factory=functools.partial(
                EngineClient, watchdog_timeout_s=config.watchdog_timeout, security=security,
                kv_listener=None if self.kv_events is None else self.kv_events.on_session_response),
            policy=policy,
            prefix_index=PrefixIndex(config.prefix_index_max_blocks)
            if policy is RoutingPolicy.CACHE_AWARE else None,
            prefill_tokens_per_request=config.prefill_tokens_per_request,
        )
        self._weight_sync = WeightSync(self.balancer)
        self.capacities = EngineCapacities(self.balancer)
        self.observability.registry.register(ServerLoadCollector(
            config.served_model_name or model.name, self.balancer, self.capacities,
            config.vllm_metric_names))
        self._model = model
        self._pipeline = Pipeline(config, tokenizer, model, self.balancer, self.observability,
                                  pooler)
        self._servicer = GenerateServicer(config, self._pipeline, tokenizer, model,
                                          self.balancer)
        self.pooling = PoolingOperations(config, self._pipeline, tokenizer, model, pooler,
                                         self._pipeline.pooling)
        self._answering = ChatAnswering(config, self._pipeline, tokenizer,
                                        chat_templates or ChatTemplates(default=None),
                                        model.eos_token_ids)
        self._chat = ChatServicer(self._answering)
        self._server: grpc.aio.Server | None = None
        self._http: HttpServer | None = None
        self.http_port = -1
        self.http_scheme = "http"
        self._health: AioHealth | None = None
        self._watcher: LoadWatcher | None = None
        self._health_lock = asyncio.Lock()
        self._background: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self) -> int:
        """Serve and start following engines; returns the bound port."""
        api_keys, admin_keys = _client_keys(self._config)
        server = grpc.aio.server(
            options=server_options(self._config.max_message_bytes,
                                   self._config.max_concurrent_streams),
            interceptors=[*self.observability.aio_interceptors(),
                          *_auth_interceptors(api_keys, admin_keys),
                          RejectMalformedInterceptor()])
        generate_pb2_grpc.add_GenerateServiceServicer_to_server(self._servicer, server)
        chat_pb2_grpc.add_ChatServiceServicer_to_server(self._chat, server)
        pooling_pb2_grpc.add_PoolingServiceServicer_to_server(
            PoolingServicer(self._config, self.pooling), server)
        admin_pb2_grpc.add_AdminServiceServicer_to_server(
            admin.AdminServicer(self.balancer,
                                restart_status_file=self._config.restart_status_file,
                                weight_sync=self._weight_sync), server)
        services = [generate_service.SERVICE_NAME, chat_service.SERVICE_NAME,
                    pooling_service.SERVICE_NAME, admin.SERVICE_NAME]
        if self.kv_events is not None:
            vllm_pb2_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(
                self._config, self._pipeline, self.pooling, self._model, self.balancer,
                self._weight_sync, self.kv_events, self._kv_tokens), server)
            services.append(vllm_service.SERVICE_NAME)
        self._health = await add_aio_health_and_reflection(
            server, services, self._security.reflection)
        # Both ports are bound before either serves: a busy one (PortUnavailable) stops
        # the start with nothing running.
        address = host_port(self._config.host, self._config.port)
        self.port = bind(server, address, self._security)
        if self._config.http_port >= 0:
            # Any key the gRPC API takes is good for the HTTP API; its RL routes (pause,
            # weight updates) need an admin key where there are any, as AdminService does.
            http_api = self._http_api(frozenset(api_keys + admin_keys), frozenset(admin_keys))
            self._http = HttpServer(http_api, self._config.host, self._config.http_port,
                                    self._security)
        await server.start()
        self._server = server
        if self._http is not None:
            await self._http.start()
            self.http_port = self._http.port
            self.http_scheme = self._http.scheme
        self._health_server = await start_aio_health_port(self._health, self._security)
        if self._config.coordinator:
            self._watcher = LoadWatcher(self._config.coordinator, self.balancer, self._security)
            self._watcher.start()
        else:
            await self.balancer.set_static(self._config.engines)
        self.capacities.start()
        return self.port

    async def stop(self, drain_timeout_s: float) -> None:
        """Go NOT_SERVING, refuse new calls, let running ones finish within
        `drain_timeout_s`, end the rest with UNAVAILABLE, stop."""
        self._pipeline.drain()
        await self._publish_readiness()
        started = time.monotonic()
        await self._wait_until_idle(drain_timeout_s)
        left = self._pipeline.num_running
        self._pipeline.end_running(
            f"the frontend is shutting down; the request did not finish within the "
            f"{drain_timeout_s:g} s drain timeout")
        log.info("drained in %.2f s; %d requests left, ended with UNAVAILABLE",
                 time.monotonic() - started, left)
        await self._wait_until_idle(_FINAL_GRACE_S)
        if self._http is not None:
            await self._http.stop()
        if self._server is not None:
            await self._server.stop(_FINAL_GRACE_S)
        if self._health_server is not None:
            await self._health_server.stop(0)
        if self._watcher is not None:
            await self._watcher.close()
        await self.capacities.close()
        await self.balancer.close()

    def _http_api(self, keys: frozenset[bytes], admin_keys: frozenset[bytes]) -> OpenAIApi:
        config = self._config
        names = tuple(dict.fromkeys(n for n in (config.served_model_name, self._model.name,
                                                self._model.path) if n))
        settings = HttpSettings(model_names=names, max_model_len=self._model.max_model_len,
                                max_body_bytes=config.max_message_bytes, api_keys=keys,
                                admin_keys=admin_keys,
                                root=self._model.path or self._model.name,
                                limits=http_limits(config))
        worker = WorkerState(
            self._model, names[0], lambda: engine_loads(self.balancer, self.capacities),
            lambda: self.balancer.tensor_parallel_size, lambda: self.balancer.weight_version)
        return OpenAIApi(settings, self._pipeline, self._answering,
                         lambda: self.balancer.ready, self.observability.registry,
                         self._weight_sync, self.pooling, worker)

    async def _wait_until_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self._pipeline.num_running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def _kv_tokens(self, address: str) -> int:
        """An engine's KV-cache size in tokens, as last read (0 before)."""
        capacity = self.capacities.get(address)
        return 0 if capacity is None else capacity.block_size * capacity.num_blocks

    def _on_readiness(self, ready: bool) -> None:
        task = asyncio.get_running_loop().create_task(self._publish_readiness())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _publish_readiness(self) -> None:
        # Publish the current state, not the event's: tasks may run late but the
        # last one to run always writes the truth.
        async with self._health_lock:
            if self._health is not None:
                await self._health.set_ready(self.balancer.ready and not self._pipeline.draining)


def _client_keys(config: FrontendConfig) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
    """(API keys, admin keys) from their files; both empty when auth is off."""
    api_keys = load_keys(config.api_key_file, "api_key_file") if config.api_key_file else ()
    admin_keys = (load_keys(config.admin_api_key_file, "admin_api_key_file")
                  if config.admin_api_key_file else ())
    return api_keys, admin_keys


def _auth_interceptors(api_keys: tuple[bytes, ...],
                       admin_keys: tuple[bytes, ...]) -> list[grpc.aio.ServerInterceptor]:
    if not api_keys and not admin_keys:
        return []
    # vLLM's API holds operator calls too (cache flush, profiler): admin, as AdminService's.
    return [BearerAuthInterceptor(api_keys, admin_keys, admin_services=[admin.SERVICE_NAME],
                                  admin_methods=vllm_service.ADMIN_METHODS)]
