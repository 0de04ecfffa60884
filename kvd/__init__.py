"""kvd: a multi-tenant LLM serving daemon with an accountable KV-cache pool."""

__version__ = "0.1.0"
