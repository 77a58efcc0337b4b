"""The web console at ``/console``: server-rendered pages (Jinja2) over the services, with a small
script of our own for live progress (Socket.IO ``batch:progress``) and the upload. Nothing is loaded from any
other host (``Content-Security-Policy: default-src 'self'``)."""

from .app import ConsoleRoot, create_console
from .state import ConsoleState

__all__ = ["ConsoleRoot", "ConsoleState", "create_console"]
