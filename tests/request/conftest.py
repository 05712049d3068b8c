"""The request path is tested through a whole proxy in front of fake workers (the front door's harness)."""

from tests.server.conftest import make_proxy

__all__ = ["make_proxy"]
