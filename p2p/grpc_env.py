"""gRPC core's own log level in a peer process: imported for its effect before ``grpc`` is.

gRPC core reads ``GRPC_VERBOSITY`` once, when ``grpc`` is imported, and at its default level logs
one line per failed TLS handshake (``ssl_transport_security.cc ... Handshake failed``): a
stranger opening connections without a client certificate could grow a peer's log without
bound. Importing this module first sets ``GRPC_VERBOSITY=ERROR`` unless the environment already
says otherwise (``GRPC_VERBOSITY=INFO`` brings gRPC core's lines back for debugging). graphfl
counts the connections it refuses itself and logs them rate-limited
(:class:`graphfl.p2p.socket_data.PreauthLog`, :meth:`graphfl.p2p.transport.Mailbox.note_rejection`).
"""

from __future__ import annotations

import os
import sys

VERBOSITY = "ERROR"
"""gRPC core's level in a peer process unless ``GRPC_VERBOSITY`` is set."""

effective: str = os.environ.setdefault("GRPC_VERBOSITY", VERBOSITY)
"""The level gRPC core uses in this process (if grpc was not imported before this module)."""
imported_before: bool = "grpc" in sys.modules
"""``True`` when grpc was already imported, so ``GRPC_VERBOSITY`` came too late to matter."""
