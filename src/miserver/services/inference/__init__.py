"""Inference: the endpoint services (chat, completions, embeddings, probes, Responses, Anthropic Messages), the
checks they share, the service context (engine, admission, model names, provenance), routing to the resident engine
or an upstream, and the many-rows call of the batch runner.

May import ``services.accounts`` (metering), ``engines``, ``scheduling``, ``store``, ``protocol``; never
``services.batch_api`` or anything above ``services``.
"""
