"""Upstream engines (gateway mode, DESIGN §8): OpenAI-compatible servers (vLLM, SGLang, llama.cpp, another
miServer) behind miServer's durable queue. :mod:`.config` reads ``--upstream`` entries, :mod:`.client` is one
upstream (pooled client, discovery, health), :mod:`.pool` the pools and their gates, :mod:`.retry` the one retry
loop, :mod:`.gateway` what keeps the pools fresh, :mod:`.errors` the retry rules and the error-envelope table."""

from .client import UPSTREAM_PATHS, ServedModel
from .config import Timeouts, UpstreamConfig, parse_upstreams
from .gateway import Gateway, KnownUpstream, start_gateway
from .pool import UpstreamPool
from .retry import Answer, Deferred, RetryPolicy, send

__all__ = [
    "UPSTREAM_PATHS",
    "Answer",
    "Deferred",
    "Gateway",
    "KnownUpstream",
    "RetryPolicy",
    "ServedModel",
    "Timeouts",
    "UpstreamConfig",
    "UpstreamPool",
    "parse_upstreams",
    "send",
    "start_gateway",
]
