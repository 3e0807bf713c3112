"""`corestream frontend`: load the tokenizer and chat template, serve GenerateService and
ChatService until a signal."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Callable

from services.common.config import from_args
from services.common.logs import setup_logging
from services.common.model_info import ModelInfo, load_model_info
from services.common.observability import Observability
from services.common.observability_config import ObservabilityConfig
from services.common.pooling import Pooler, PoolingConfig, resolve_pooler
from services.common.ports import PortUnavailable
from services.common.security_config import SecurityConfig
from services.common.startup_heap import freeze_startup_objects
from services.common.tiny_checkpoint import resolve_model
from services.frontend.chat.answering import load_templates
from services.frontend.chat.template import ChatTemplates, TemplateError
from services.frontend.config import FrontendConfig
from services.frontend.server import FrontendServer
from services.frontend.tokenizer import TextTokenizer

log = logging.getLogger(__name__)


def run(args: argparse.Namespace) -> int:
    config = from_args(FrontendConfig, args)
    security = from_args(SecurityConfig, args)
    obs_config = from_args(ObservabilityConfig, args)
    setup_logging("frontend", config.log_level, obs_config.log_format)
    if not config.coordinator and not config.engines:
        log.error("nothing to route to: give --coordinator HOST:PORT or --engines HOST:PORT ...")
        return 2
    log.info("config: %s", config)
    model_dir = resolve_model(config.model or None)
    model = load_model_info(model_dir)
    try:
        pooler = resolve_pooler(model_dir, from_args(PoolingConfig, args))
    except (OSError, ValueError) as exc:
        log.error("cannot serve %s: %s", model_dir, exc)
        return 2
    tokenizer = TextTokenizer.from_dir(model_dir)
    try:
        templates = load_templates(config, model_dir)
    except (OSError, TemplateError) as exc:
        log.error("cannot load the chat template: %s", exc)
        return 2
    if templates.default is None and not templates.named:
        log.warning("the model has no chat template: ChatService answers FAILED_PRECONDITION "
                    "until one is given with --chat-template FILE")
    log.info(
        "model %s: vocab %d, context %d tokens", model.name, model.vocab_size, model.max_model_len
    )
    if pooler is not None:
        log.info("pooling model: %s (%s pooling, normalize %s; from %s)",
                 " and ".join(pooler.tasks), pooler.pooling_type.value, pooler.normalize,
                 pooler.source)
    observability = Observability("frontend", obs_config, config.host, (config, security))
    loop_factory = event_loop_factory(config.event_loop)
    log.info("event loop: %s", "uvloop" if loop_factory else "asyncio")
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(_serve(config, security, tokenizer, model, observability, templates,
                                 pooler))


def event_loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop factory for "uvloop" (ImportError without it) and "auto" where it is
    installed; None (asyncio's own loop) otherwise."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise
        return None
    return uvloop.new_event_loop


async def _serve(config: FrontendConfig, security: SecurityConfig, tokenizer: TextTokenizer,
                 model: ModelInfo, observability: Observability,
                 templates: ChatTemplates, pooler: Pooler | None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = FrontendServer(config, tokenizer, model, security, observability, templates, pooler)
    port = await server.start()
    try:
        observability.start_metrics()
    except PortUnavailable:
        await server.stop(0)  # stopped on this loop, not left to the loop's close
        raise
    log.info("frontend listening on %s:%d", config.host, port)
    freeze_startup_objects()
    if server.http_port >= 0:
        log.info("OpenAI-compatible HTTP API on %s://%s:%d/v1", server.http_scheme, config.host,
                 server.http_port)
    await stop.wait()
    log.info("shutting down: NOT_SERVING, letting running requests finish (%g s)",
             config.shutdown_timeout)
    await server.stop(config.shutdown_timeout)
    observability.shutdown()
    log.info("frontend stopped")
    return 0
