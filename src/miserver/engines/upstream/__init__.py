"""Upstream engines (gateway mode, DESIGN §8): OpenAI-compatible servers (vLLM, SGLang, llama.cpp, another
miServer) behind miServer's durable queue. :mod:`.config` reads ``--upstream`` entries, :mod:`.client` is one
upstream (pooled client, discovery, health), :mod:`.pool` the pools, their gates and the retry loop, :mod:`.errors`
the retry rules and the error-envelope table."""

from .client import UPSTREAM_PATHS, ServedModel
from .config import Timeouts, UpstreamConfig, parse_upstreams
from .pool import Answer, Deferred, Gateway, KnownUpstream, RetryPolicy, UpstreamPool, send, start_gateway

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
