"""The KV-event publisher: the KV manager's event log sent to inference
gateways over ZMQ, in vLLM's wire format, off the step's path.

Each message on the PUB socket is ``[topic, seq, payload]``: ``seq`` an
8-byte big-endian counter from 0, ``payload`` a msgpack ``[ts, events,
data_parallel_rank]``, each event an array or a map (``kv_events.encoding``;
``kvd.kv.events``). A subscriber that sees a gap in ``seq`` asks the ROUTER
replay socket for the batches from a sequence on (an 8-byte big-endian
start), and gets each buffered one as ``[seq, payload]``, then ``[-1, b""]``.

The socket is an XPUB, so it hears each subscriber arrive: the next batch is
then a resync (``AllBlocksCleared`` and every block held), so a router that
starts or reconnects after the replica learns what it already holds, which a
plain PUB would never tell it (and a replay only as far back as its buffer).

The step loop hands each step's events over with ``offer``, which never
blocks: the batch goes into a bounded queue that one thread drains to the
sockets (PUB drops for a subscriber past its high-water mark rather than
wait). If the queue is full, the batch is not queued and the overflow is
counted; the next batch that fits is a resync (``AllBlocksCleared`` then
every block held), so a subscriber's view is whole again without a replay.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections import deque

import msgspec
import structlog
import zmq

from kvd.kv.events import EventBatch, EventEncoding, KVEventLog, batch, on_wire
from kvd.server.config import KVEventsSection

log = structlog.get_logger("kvd.kvevents")

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.1


class KVEventsError(OSError):
    """A socket of ``[kv_events]`` cannot be opened (one line for the operator)."""


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host or a local transport is bound; a named
    host is a gateway's socket to connect to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    def __init__(self, section: KVEventsSection, *, rank: int = 0) -> None:
        self.section = section
        self.rank = rank
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=section.max_queue)
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's arrival, not the first
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._open(self._pub, section.endpoint, binds(section.endpoint), "endpoint")
            if section.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._open(self._replay, section.replay_endpoint, True, "replay_endpoint")
        except KVEventsError:
            self._close_sockets()
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or section.endpoint
        self.replay_endpoint = (
            self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None
        )
        self._topic = section.topic.encode()
        # The last buffer_steps batches, for replays.
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=section.buffer_steps)
        self._next_seq = 0
        self._resync = False
        # Set by the publisher thread when a subscriber arrives, read and
        # cleared by the step loop's offer (a bool: atomic under the GIL).
        self._joined = False
        self.encoding = EventEncoding(section.encoding)
        # Read by the metrics (ints: a torn read is impossible under the GIL).
        self.accepted = 0  # batches queued
        self.published = 0  # batches sent
        self.overflows = 0  # batches not queued: the queue was full
        self.replays = 0  # replay requests answered
        self.subscribers_joined = 0
        self._log: KVEventLog | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def _open(self, sock: zmq.Socket[bytes], endpoint: str, bind: bool, key: str) -> None:
        try:
            sock.bind(endpoint) if bind else sock.connect(endpoint)
        except zmq.ZMQError as exc:
            verb = "bind" if bind else "connect to"
            raise KVEventsError(f"kv_events.{key}: cannot {verb} {endpoint}: {exc}") from None

    # -- the step loop's side ------------------------------------------------------

    @property
    def events(self) -> KVEventLog | None:
        return self._log

    def attach(self, events: KVEventLog) -> None:
        self._log = events

    def offer(self) -> None:
        """Queue what the attached log holds since the last call; never blocks.
        The batch is a resync after an overflow or a subscriber's arrival."""
        events = self._log
        joined = self._joined
        if joined:
            self._joined = False
        if events is None or not (events.pending() or self._resync or joined):
            return
        if self._queue.full():
            self.overflows += 1
            self._resync = True
            events.take()  # superseded by the resync
            return
        if self._resync:
            log.warning("kv_events.resync", reason="overflow", overflows=self.overflows)
        elif joined:
            log.info("kv_events.resync", reason="subscriber_joined")
        taken = events.resync() if self._resync or joined else events.take()
        self._resync = False
        self._queue.put_nowait(batch(taken, self.rank))
        self.accepted += 1

    def queued(self) -> int:
        return self._queue.qsize()

    def close(self) -> None:
        """Send what is queued (for at most a second or two), then close the sockets."""
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=1.0)
        self._thread.join(timeout=1.0)
        self._stopping.set()  # a queue still full: the thread stops after its current batch
        self._thread.join(timeout=1.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()

    # -- the publisher thread ----------------------------------------------------------

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)  # subscriptions
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._stopping.is_set():
            ready = dict(poller.poll(0))
            if self._pub in ready:
                self._hear_subscriptions()
            if self._replay is not None and self._replay in ready:
                self._answer_replay()
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            payload = encoder.encode(on_wire(item, self.encoding))
            seq = self._next_seq
            self._next_seq += 1
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError as exc:  # a connect endpoint's peer gone: buffered, replayable
                log.warning("kv_events.send_failed", error=str(exc), seq=seq)
            self._buffer.append((seq, payload))
            self.published += 1

    def _hear_subscriptions(self) -> None:
        """Read what subscribers sent the XPUB; an arrival (a subscribe
        message, first byte 1) asks the step loop for a resync."""
        while True:
            try:
                message = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if message[:1] == b"\x01":
                self.subscribers_joined += 1
                self._joined = True
                log.info("kv_events.subscriber_joined", topic=message[1:].decode(errors="replace"))

    def _answer_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv_events.bad_replay_request", frames=len(frames))
            return
        client, empty, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((client, empty, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, empty, END_OF_REPLAY, b""))
        self.replays += 1
