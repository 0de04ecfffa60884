"""structlog JSON lines on stdout, one event per line, stable event names.

Events: lifecycle.* (start, listening, loading, warmup, calibrated, ready,
draining, drain_timeout, stopped, hard_exit, forced_exit, failed,
load_failed, calibrating, previous_failures, faults_armed),
request.accepted (the API took it), request.start (the scheduler started
it: queue steps and seconds, cached tokens), request.finish,
request.refused, request.failed (a fault of its own), request.error (a
handler's bug), tenant.rate_limited, kv.preempt, kv.copy_failed,
engine.step, engine.failed, engine.late_compile (a program compiled
after warm-up: a shape no bucket covers), engine.compile_cache_unusable,
engine.compile_cache_entry_dropped, kv_events.resync (the publisher's
queue was full), kv_events.send_failed, kv_events.bad_replay_request,
lifecycle.kv_events, admin.audit, admin.socket_lost,
admin.socket_restored, admin.socket_rebind_failed; several processes
(docs/howto/multi-host.md): distributed.joining, distributed.joined,
distributed.following (a follower is ready), distributed.followers_stopped
(the leader, after its drain), distributed.stopped (a follower told to
stop), distributed.process_lost (one line naming the lost processes, then
exit 1), distributed.follower_failed. Prompt and completion text appear only
when ``server.log_prompts`` is on.
"""

from __future__ import annotations

import logging
import sys

import msgspec
import structlog

_encoder = msgspec.json.Encoder()


def _serialize(event: dict[str, object], **_: object) -> str:
    return _encoder.encode(event).decode()


def configure_logging(level: int = logging.INFO) -> None:
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # a pipe (systemd, tests) sees each line
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=_serialize),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.WriteLoggerFactory(file=sys.stdout),
        cache_logger_on_first_use=True,
    )
