"""The scheduler: continuous batching and multi-tenant policy over the KV core
and the engine. Sans-IO and synchronous: the daemon calls ``step()``."""
