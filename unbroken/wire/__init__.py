"""The bottom layer: bytes on a socket. Framing and authentication shared by every listener.

Every other layer (control, comm, checkpoint) talks over TCP; this package is the one place
that reads exact byte counts, bounds frame sizes and authenticates a connection, so a fix to
either lands everywhere at once. It imports nothing from the rest of unbroken but ``config``.
"""
