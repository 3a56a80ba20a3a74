"""The pure logic of the ICCL exchange: chunk schedule, frames, acks and resends, failover.

Nothing here touches a socket or a clock of its own; the shell (:mod:`unbroken.comm.iccl.link`)
feeds it events and does what it answers, so every rule below is tested without processes.

Ring all-reduce over ``n`` members: the tensor is cut into ``n`` segments and every segment into
the same number ``C`` of chunks. Rank ``r`` sends to ``r+1`` and receives from ``r-1``. In
reduce-scatter step ``k`` (``0 <= k < n-1``) it sends segment ``r-k`` and adds segment ``r-k-1``
into its own; in all-gather step ``k`` it sends segment ``r-k+1`` and overwrites segment ``r-k``.
The chunks of one hop form one stream numbered ``0 .. 2(n-1)C - 1``; chunk ``i`` of step ``s >= 1``
leaves only after chunk ``i - C`` (the same chunk of step ``s-1``) has been received, so the
ring pipelines chunk by chunk instead of step by step.

Every frame carries a CRC-32C over its payload and header; the receiver accepts chunks strictly
in order (go-back-N), acknowledges cumulatively, and answers a corrupt chunk, or one ahead of
the next it expects, with a NACK: the sender rewinds to it. Because a chunk the successor has not
accepted cannot yet have come back around the ring reduced, its bytes in the sender's tensor
are still the ones first sent, so a resend needs no copy.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import struct

import crc32c as _crc32c

# kind, path, reserved, collective sequence number, chunk index, payload bytes, CRC-32C
HEADER = struct.Struct("!BBHIIII")
HEADER_BYTES = HEADER.size
_HEAD = HEADER_BYTES - 4  # the bytes the CRC covers besides the payload
ALL_CHUNKS = 0xFFFFFFFF  # an ACK's chunk: "every chunk of that collective arrived"
SEQ_MOD = 1 << 32


class Kind(enum.IntEnum):
    DATA = 1
    ACK = 2  # chunk = how many chunks of ``seq`` were accepted (cumulative)
    NACK = 3  # chunk = the next chunk the receiver needs: resend from there


class ProtocolError(ConnectionError):
    """A frame that cannot come from a well-behaved peer: the connection is dropped."""


@dataclasses.dataclass(frozen=True)
class Frame:
    kind: Kind
    path: int
    seq: int
    chunk: int
    nbytes: int
    crc: int


def crc_of(payload: memoryview | bytes, value: int = 0) -> int:
    """CRC-32C of ``payload`` (continued from ``value``); releases the GIL on large buffers."""
    return int(_crc32c.crc32c(payload, value))


def pack(kind: Kind, path: int, seq: int, chunk: int, nbytes: int, payload_crc: int = 0) -> bytes:
    """A frame header; its CRC covers the payload (``payload_crc``) and the header's fields."""
    head = HEADER.pack(kind, path, 0, seq % SEQ_MOD, chunk, nbytes, 0)[:_HEAD]
    return head + struct.pack("!I", crc_of(head, payload_crc))


def unpack(header: bytes | bytearray | memoryview, max_payload: int) -> Frame:
    """Parses and checks a header read from the network.

    Raises:
        ProtocolError: unknown kind or path, a payload over ``max_payload`` or on a control frame,
            or (control frames) a CRC mismatch: the stream cannot be trusted any further.
    """
    kind, path, _, seq, chunk, nbytes, crc = HEADER.unpack(header)
    if kind not in (1, 2, 3) or path > 1:
        raise ProtocolError(f"a frame of unknown kind {kind} or path {path}: the connection is out of step")
    k = Kind(kind)
    if k is Kind.DATA:
        if nbytes > max_payload:
            raise ProtocolError(f"a {nbytes}-byte chunk announced; chunks here are at most {max_payload} bytes")
    elif nbytes or crc != crc_of(bytes(header[:_HEAD])):
        raise ProtocolError(f"a corrupt {k.name} frame")
    return Frame(k, path, seq, chunk, nbytes, crc)


def payload_ok(frame: Frame, header: bytes | bytearray | memoryview, payload_crc: int) -> bool:
    """Whether a DATA frame's payload and header match the CRC it carries."""
    return crc_of(bytes(header[:_HEAD]), payload_crc) == frame.crc


def seq_before(a: int, b: int) -> bool:
    """Whether sequence number ``a`` comes before ``b`` (modulo 2**32)."""
    return a != b and (b - a) % SEQ_MOD < SEQ_MOD // 2


# -- the chunk schedule ----------------------------------------------------------------------


def even_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous, nearly equal slices of ``range(n)`` (some empty when n < parts)."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


@dataclasses.dataclass(frozen=True)
class RingSchedule:
    """Which elements rank ``rank`` sends and receives, chunk by chunk (see the module's doc)."""

    numel: int
    size: int
    rank: int
    chunk_elems: int

    def __post_init__(self) -> None:
        if self.size < 2 or not 0 <= self.rank < self.size:
            raise ValueError(f"a ring needs size >= 2 and 0 <= rank < size, got rank {self.rank} of {self.size}")
        if self.chunk_elems < 1 or self.numel < 0:
            raise ValueError(f"need chunk_elems >= 1 and numel >= 0, got {self.chunk_elems}, {self.numel}")

    @property
    def segments(self) -> list[tuple[int, int]]:
        return even_bounds(self.numel, self.size)

    @property
    def chunks_per_step(self) -> int:
        largest = max(e - s for s, e in self.segments)
        return max(1, math.ceil(largest / self.chunk_elems))

    @property
    def steps(self) -> int:
        return 2 * (self.size - 1)

    @property
    def total(self) -> int:
        """Chunks in each direction of the hop."""
        return self.steps * self.chunks_per_step

    def _segment(self, step: int, send: bool) -> int:
        n, r = self.size, self.rank
        if step < n - 1:
            return (r - step) % n if send else (r - step - 1) % n
        k = step - (n - 1)
        return (r - k + 1) % n if send else (r - k) % n

    def _item(self, i: int, send: bool) -> tuple[int, int, bool]:
        if not 0 <= i < self.total:
            raise IndexError(f"chunk {i} out of 0..{self.total - 1}")
        step, c = divmod(i, self.chunks_per_step)
        s0, s1 = self.segments[self._segment(step, send)]
        a, b = even_bounds(s1 - s0, self.chunks_per_step)[c]
        return s0 + a, s0 + b, step < self.size - 1

    def send_item(self, i: int) -> tuple[int, int]:
        """Element range ``[start, end)`` of the ``i``-th chunk sent."""
        a, b, _ = self._item(i, True)
        return a, b

    def recv_item(self, i: int) -> tuple[int, int, bool]:
        """Element range of the ``i``-th chunk received, and whether it is added (else copied)."""
        return self._item(i, False)

    def received_before_send(self, i: int) -> int:
        """How many chunks must have been received before chunk ``i`` may be sent."""
        return max(0, i - self.chunks_per_step + 1)


# -- acknowledgements and resends -------------------------------------------------------------


class SendWindow:
    """The sender's side of one collective on one hop: what was sent, what the peer holds.

    ``acked`` is cumulative (the peer holds every chunk below it); ``next`` is the next chunk to
    put on the wire. At most ``window`` chunks are unacknowledged, which bounds the resend after a
    failover. A peer's ACK or NACK is a claim, checked against what was sent.
    """

    def __init__(self, total: int, window: int) -> None:
        if total < 0 or window < 1:
            raise ValueError(f"need total >= 0 and window >= 1, got {total}, {window}")
        self.total, self.window = total, window
        self.next = 0
        self.acked = 0
        self.resent = 0  # chunks put on the wire again (NACKs, failovers)
        self._high = 0  # one past the highest chunk ever sent

    def can_send(self) -> bool:
        return self.next < self.total and self.next - self.acked < self.window

    def sent(self) -> int:
        """Marks chunk ``next`` sent; returns its index."""
        if not self.can_send():
            raise RuntimeError("nothing may be sent now")
        i = self.next
        if i < self._high:
            self.resent += 1
        self.next += 1
        self._high = max(self._high, self.next)
        return i

    def ack(self, upto: int) -> bool:
        """The peer holds every chunk below ``upto``; whether that advanced ``acked``.

        Raises:
            ProtocolError: the peer acknowledges a chunk never sent.
        """
        if upto == ALL_CHUNKS:
            upto = self.total
        if upto > self._high:
            raise ProtocolError(f"the peer acknowledged {upto} chunks; only {self._high} were sent")
        if upto <= self.acked:
            return False
        self.acked = upto
        self.next = max(self.next, upto)
        return True

    def nack(self, chunk: int) -> None:
        """The peer needs ``chunk`` again (it arrived corrupt, or later ones came first)."""
        if chunk > self._high or chunk < 0:
            raise ProtocolError(f"the peer asked for chunk {chunk}; only {self._high} were sent")
        if chunk < self.acked:
            return  # stale: everything below acked has arrived since
        self.next = min(self.next, chunk)

    def rewind(self) -> None:
        """After a failover: resend every chunk the peer has not acknowledged."""
        self.next = self.acked

    @property
    def done(self) -> bool:
        return self.acked >= self.total

    @property
    def quiet(self) -> bool:
        """Nothing in flight: a path can change without reordering chunks."""
        return self.next == self.acked


class Verdict(enum.Enum):
    ACCEPT = "accept"
    DUPLICATE = "duplicate"  # already accepted: drop it, acknowledge again
    AHEAD = "ahead"  # a later chunk: drop it; NACK the expected one (once)


class RecvCursor:
    """The receiver's side of one collective on one hop: chunks accepted strictly in order."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.expected = 0
        self.corrupt = 0  # chunks that failed their CRC
        self._nacked = -1  # the expected chunk already NACKed for a frame ahead of it

    def classify(self, chunk: int) -> Verdict:
        if chunk < self.expected:
            return Verdict.DUPLICATE
        if chunk == self.expected:
            return Verdict.ACCEPT
        if chunk >= self.total:
            raise ProtocolError(f"chunk {chunk} of a collective of {self.total} chunks")
        return Verdict.AHEAD

    def accepted(self) -> None:
        self.expected += 1

    def nack_ahead(self) -> bool:
        """Whether a frame ahead of ``expected`` should be answered with a NACK (once per chunk)."""
        if self._nacked == self.expected:
            return False
        self._nacked = self.expected
        return True

    def corrupted(self) -> None:
        self.corrupt += 1
        self._nacked = self.expected

    @property
    def done(self) -> bool:
        return self.expected >= self.total


# -- the paths of one hop --------------------------------------------------------------------

PRIMARY, BACKUP = 0, 1
PATH_NAMES = ("primary", "backup")


@dataclasses.dataclass
class PathEvent:
    t: float
    path: int
    what: str  # "down", "up", "failover", "failback"
    why: str = ""


class HopPaths:
    """Which connection a hop sends on: the primary while it works, else the backup.

    ``failed`` moves the hop to the other path when that one is up; ``restored`` (a redial of the
    path answered) brings it back, and a restored primary is taken again once nothing is in flight
    (the caller asks :meth:`want_failback`). Events are kept for the diagnosis, a bounded number.
    """

    MAX_EVENTS = 256

    def __init__(self) -> None:
        self.up = [False, False]
        self.active = PRIMARY
        self.failovers = 0
        self.failbacks = 0
        self.downs = [0, 0]
        self.events: list[PathEvent] = []

    def _event(self, t: float, path: int, what: str, why: str = "") -> None:
        self.events.append(PathEvent(t, path, what, why))
        del self.events[: -self.MAX_EVENTS]

    def restored(self, path: int, t: float) -> None:
        if not self.up[path]:
            self.up[path] = True
            self._event(t, path, "up")
        if not self.up[self.active]:
            self.active = path

    def failed(self, path: int, t: float, why: str) -> bool:
        """``path`` failed; whether the hop can go on (on the other path). Idempotent."""
        if self.up[path]:
            self.up[path] = False
            self.downs[path] += 1
            self._event(t, path, "down", why)
        if self.active == path:
            other = 1 - path
            if not self.up[other]:
                return False
            self.active = other
            if path == PRIMARY:
                self.failovers += 1
                self._event(t, other, "failover", why)
        return self.up[self.active]

    def want_failback(self) -> bool:
        return self.active == BACKUP and self.up[PRIMARY]

    def failback(self, t: float) -> None:
        if self.want_failback():
            self.active = PRIMARY
            self.failbacks += 1
            self._event(t, PRIMARY, "failback")

    @property
    def alive(self) -> bool:
        return self.up[self.active]
