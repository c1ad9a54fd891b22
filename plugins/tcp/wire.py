"""The tcp data port's wire format (protocol version 2). Every integer is big-endian
except the descriptor arrays of a batch frame, which are little-endian int64.

A data connection starts with HELLO from the initiator, then the mutual
authentication of :mod:`mpcomm.auth` (always run: with no secret configured the
proofs are zeros, and a side with a secret refuses a side without), bound to
``CONTEXT + initiator node id + target epoch``. After that it carries any number
of requests, pipelined: the initiator does not wait for a reply before sending
the next request, and the target answers each request, in order, with one reply
that names its request id.

::

    HELLO  magic "MH" | version B | flags B | initiator node id 16s | target epoch 16s        (36 bytes)
    REQ    magic "MQ" | op B | flags B | count I | req_id Q | region_id Q | token Q | epoch Q
           | offset Q | length Q | deadline d (wall clock, time.time())                      (64 bytes)
           op WRITE: then ``length`` payload bytes. With ``flags`` FLAG_NOTE (a notifying write,
           advertised as ``"write_note"``): ``count`` is the bytes of the region name the note
           names (at most MAX_NOTE_REGION), then NOTE_LEN (the note's bytes, at most MAX_NOTIFY),
           the name (UTF-8), the note, and only then the ``length`` payload bytes. The target
           checks the region and the note (limits.max_notify_bytes, the sender's notify_rate, room in its
           notification queue, which it holds) before a payload byte lands: any refusal drains the
           payload and answers ERR with the region untouched and no note queued. Else the payload
           lands, the note is queued after it, and one OK answers both. A ``count`` or NOTE_LEN
           over its limit closes the connection before anything after them is read
           op READ:  nothing
           op WRITEV/READV (one frame for ``count`` requests into one region): ``offset`` is 0,
           ``length`` the sum of the lengths; then ``count`` remote offsets and ``count`` lengths
           (int64 little-endian each); then, for WRITEV, the payloads one after the other
           op NOTIFY (a bare notification; native data port only, advertised as ``"notify"``): ``count`` bytes of the
           region name (UTF-8, at most MAX_NOTE_REGION) then ``length`` notification bytes (at most
           MAX_NOTIFY; a larger ``count``/``length`` closes the connection); region_id, token,
           epoch and offset are 0. Queued in the target's notification queue; replied OK or ERR
    REPLY  magic "MR" | status B | flags B | count I | req_id Q | length Q                     (24 bytes)
           status OK:      READ/READV: ``length`` payload bytes follow (READV: every index, in order)
           status ERR:     the whole request was refused; ``length`` bytes of JSON {code, message}
           status PARTIAL: batches only; ``count`` status bytes (0 ok, 1 refused), a JSON length I,
                           the JSON {code, message} of the first refusal, then for READV the payloads
                           of the indices that were served, in order

The target checks every index with ``ctx.regions.serve`` before touching
memory; a refused write's payload is drained into a discard buffer.

``_busypoll.c`` (``next_reply``) reads the REPLY header too: its size, magic, status
values and where ``length`` sits; tests/tcp/test_tcp_busypoll.py builds its frames
with :data:`RESP`, so a change here that it misses fails there.
"""

from __future__ import annotations

import functools
import struct
import sys

VERSION = 2
CONTEXT = b"mpcomm/tcp-data/2\0"
HELLO = struct.Struct("!2sBB16s16s")
REQ = struct.Struct("!2sBBIQQQQQQd")
RESP = struct.Struct("!2sBBIQQ")
JSON_LEN = struct.Struct("!I")
HELLO_MAGIC, REQ_MAGIC, RESP_MAGIC = b"MH", b"MQ", b"MR"
OP_WRITE, OP_READ, OP_WRITEV, OP_READV, OP_NOTIFY = 1, 2, 3, 4, 5
MAX_NOTE_REGION = 1024  # region-name bytes of a NOTIFY frame or a noting WRITE (_dataport.c)
#: ``flags`` of a REQ: the only bit defined; any other bit set closes the connection.
FLAG_NOTE = 0x01  # a WRITE that carries its notification (NOTE_LEN, name and note follow the header)
NOTE_LEN = struct.Struct("!Q")
MAX_NOTIFY = 64 << 10  # the largest note any node takes (mpcomm.engine.notify.MAX_NOTIFY, _dataport.c)
ST_OK, ST_ERR, ST_PARTIAL = 0, 1, 2
MAX_ERROR_PAYLOAD = 64 << 10
LITTLE = sys.byteorder == "little"


#: A REQ header's bytes: ``request(op, flags, count, req_id, region_id, token, epoch, offset, length,
#: deadline)``. Every frame the initiator sends starts with one built here (a C call: no Python frame
#: per request).
request = functools.partial(REQ.pack, REQ_MAGIC)


def ident(text: str) -> bytes:
    """A node id or epoch as its fixed 16-byte wire field."""
    raw = text.encode("ascii", "replace")[:16]
    return raw.ljust(16, b"\0")


def context(initiator_id: bytes, target_epoch: bytes) -> bytes:
    """What the authentication proofs are bound to: this protocol, this initiator, this target instance."""
    return CONTEXT + initiator_id + b"\0" + target_epoch
