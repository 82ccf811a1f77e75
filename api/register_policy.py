"""Which worker endpoints ``POST /register`` may make the server connect to.

A registration makes the advisor's process open a connection the operator never typed in.
Only endpoints the operator allowed are taken (docs/security.md, "Registrations"):

* the host must be a literal IP address inside one of ``networks`` (default loopback:
  ``127.0.0.0/8`` and ``::1``); the unspecified (``0.0.0.0``, ``::``), multicast and
  ``*`` addresses are never taken;
* a host name is refused unless ``resolve_names`` is on; then it is resolved once, every
  address it resolves to must be allowed, and the connection goes to that address (pinned:
  libzmq does not resolve it again, so a name that changes its answer later, DNS
  rebinding, cannot move the connection);
* with a ZMQ publisher allow-list (the advisor's ``zmq_allowed_publishers``: CURVE is
  mandatory) no registration is taken at all: vLLM and SGLang publish plain ZMQ.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

from api.errors import ApiError

DEFAULT_NETWORKS = ("127.0.0.0/8", "::1/128")

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class EndpointPolicy:
    """The endpoints registrations may connect to (module docstring).

    Attributes:
        networks: allowed networks (CIDR strings or networks).
        resolve_names: resolve host names (each resolved address must be allowed).
        closed: take no registration (a ZMQ publisher allow-list is configured).
    """

    networks: tuple[IpNetwork, ...] = field(default_factory=lambda: tuple(ipaddress.ip_network(n)
                                                                            for n in DEFAULT_NETWORKS))
    resolve_names: bool = False
    closed: bool = False

    @classmethod
    def of(cls, networks: Sequence[str], resolve_names: bool = False, closed: bool = False) -> EndpointPolicy:
        """Build from CIDR strings.

        Raises:
            ValueError: a string that is not a network.
        """
        return cls(tuple(ipaddress.ip_network(n, strict=False) for n in networks), resolve_names, closed)

    def _allowed(self, addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        if addr.is_unspecified or addr.is_multicast:
            return False
        return any(addr.version == n.version and addr in n for n in self.networks)

    def check(self, endpoint: str) -> str:
        """The endpoint to connect to for ``endpoint`` (``tcp://HOST:PORT``): the same, or
        with a resolved name replaced by its address.

        Raises:
            ApiError: 403 ``registrations_closed`` or ``endpoint_not_allowed``.
        """
        if self.closed:
            raise ApiError(403, "registrations_closed",
                           "zmq_allowed_publishers is set (CURVE is mandatory): plain ZMQ workers cannot register")
        rest = endpoint.removeprefix("tcp://")
        host, _, port = rest.rpartition(":")
        bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        try:
            addr = ipaddress.ip_address(bare)
        except ValueError:
            addr = None
        if addr is not None:
            if not self._allowed(addr):
                raise ApiError(403, "endpoint_not_allowed", f"{bare} is not in the allowed networks")
            return endpoint
        if not self.resolve_names or host == "*":
            raise ApiError(403, "endpoint_not_allowed",
                           f"{host[:64]!r} is not an IP address (host names are resolved only when allowed)")
        try:
            infos = socket.getaddrinfo(bare, int(port), proto=socket.IPPROTO_TCP)
        except (OSError, UnicodeError) as exc:
            raise ApiError(403, "endpoint_not_allowed", f"{host[:64]!r} does not resolve: {exc}") from None
        addrs = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
        if not addrs or not all(self._allowed(a) for a in addrs):
            raise ApiError(403, "endpoint_not_allowed", f"{host[:64]!r} resolves outside the allowed networks")
        first = addrs[0]
        return f"tcp://{first}:{port}" if first.version == 4 else f"tcp://[{first}]:{port}"


__all__ = ["DEFAULT_NETWORKS", "EndpointPolicy"]
