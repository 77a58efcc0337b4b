"""miServer: an OpenAI-compatible inference server whose centre is a durable Batch API."""

__version__ = "0.1.0"
