"""The HTTP side of ``deltafin serve`` below the app: listening, and a time limit on request headers.

uvicorn limits how long an idle keep-alive connection stays open, but not how long a client may
take to send a request's headers: a client that sends a few bytes and then nothing holds its
connection (and its memory) for ever. ``HeaderTimeoutH11`` is uvicorn's h11 protocol with one
addition: from the moment a connection opens, and again after each response, the next request's
headers must arrive within ``header_timeout`` seconds, or the server answers 408 and closes the
connection. (The body has its own limit, on all of it, in the app: see ``app._read_json``.)
"""
from __future__ import annotations

import errno
import socket

from ..errors import DeltafinError

_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                     b"content-length: %d\r\n\r\n%s")
_TIMEOUT_BODY = (b'{"error": {"message": "the request headers did not arrive in time", '
                 b'"type": "invalid_request_error", "param": null, "code": "header_timeout"}}')


def header_timeout_protocol(seconds: float) -> type:
    """An h11 protocol class for uvicorn that gives each request's headers `seconds` to arrive."""
    # Imported here: every command imports this module (serve's arguments), only serving needs uvicorn.
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not self._waiting_after:  # a new request's headers arrived
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._waiting_after = self.cycle
            self._head_timer = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            timer = getattr(self, "_head_timer", None)
            if timer is not None:
                timer.cancel()
                self._head_timer = None

        def _expired(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.logger.info("closing a connection whose request headers did not arrive within %g s", seconds)
                self.transport.write(_TIMEOUT_RESPONSE % (len(_TIMEOUT_BODY), _TIMEOUT_BODY))
                self.transport.close()

    return HeaderTimeoutH11


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, or a DeltafinError saying why there cannot be one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OverflowError:
        raise DeltafinError(f"cannot listen on port {port}: ports are 0..65535") from None
    except socket.gaierror as e:
        raise DeltafinError(f"cannot listen on {host}:{port}: unknown host ({e.strerror})") from None
    except OSError as e:
        hint = " (another server is using it: pick another --port)" if e.errno == errno.EADDRINUSE else ""
        raise DeltafinError(f"cannot listen on {host}:{port}: {e.strerror}{hint}") from None
