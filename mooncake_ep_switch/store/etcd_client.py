"""Requests to an etcd v3 cluster's JSON gateway (`/v3/...`), with what the etcd3gw client lacks.

etcd3gw (`pip install etcd3gw`, the `etcd` extra) speaks the gateway of one member over HTTP(S)
with TLS client certificates. `EtcdConnection` adds, by hand:

* a list of endpoints with failover: a request that cannot reach its member, times out, or meets a
  member without a leader (gRPC Unavailable) goes to the next member, until the caller's deadline;
* the user/password login (`/v3/auth/authenticate`) and a new token when the old one expired;
* a lease for short-lived keys (`lease()`), granted again before it runs out (no keep-alive stream);
* a deadline on every request (each attempt at most `request_s`), one client per thread (requests'
  sessions are not shared between threads).

Errors: `StoreUnavailable` (no member answered by the deadline), `PermissionError` (wrong
credentials, a permission the user lacks), `StoreRefused` (any other refusal), each naming the cluster.
"""
import base64
import importlib
import json
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from mooncake_ep_switch.errors import StoreRefused, StoreUnavailable

__all__ = ["EtcdConnection", "b64", "unb64"]

# gRPC status codes the gateway returns in its JSON error body.
_UNAVAILABLE, _DEADLINE, _UNAUTHENTICATED, _PERMISSION, _NOT_FOUND, _INVALID = 14, 4, 16, 7, 5, 3
LEASE_TTL_S = 120  # the lease of short-lived keys; granted anew after half of it


def b64(data) -> str:
    """`data` (str or bytes) as the gateway's base64 text."""
    if isinstance(data, str):
        data = data.encode()
    return base64.b64encode(bytes(data)).decode()


def unb64(text: Optional[str]) -> bytes:
    """The bytes of the gateway's base64 text (b"" for a missing field)."""
    return base64.b64decode(text) if text else b""


def _etcd3gw():
    try:
        client = importlib.import_module("etcd3gw.client")  # (etcd3gw's package also has a function `client`)
        exceptions = importlib.import_module("etcd3gw.exceptions")
    except ImportError as error:  # pragma: no cover - the etcd extra is missing
        raise ImportError("the etcd store needs the etcd3gw client: pip install 'mooncake-ep-switch[etcd]' "
                          "(or pip install etcd3gw)") from error
    return client, exceptions


class EtcdConnection:
    """Endpoints of one etcd cluster, with failover, login and TLS.

    Arguments:
        endpoints: `(host, port)` of each member's client listener.
        secure: True for HTTPS.
        user, password: credentials (both or neither).
        ca_cert: CA bundle that signed the members' certificates (HTTPS).
        cert, key: client certificate and key files (both or neither).
        request_s: longest wait for one attempt on one member (a stalled member is left after it).
    """

    def __init__(self, endpoints: List[Tuple[str, int]], secure: bool = False, user: Optional[str] = None,
                 password: Optional[str] = None, ca_cert: Optional[str] = None, cert: Optional[str] = None,
                 key: Optional[str] = None, request_s: float = 3.0):
        self.endpoints = list(endpoints)
        self.secure = secure
        self.user, self.password = user, password
        self.ca_cert, self.cert, self.key = ca_cert, cert, key
        self.request_s = request_s
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.endpoints)
        self.name = f"{'etcds' if secure else 'etcd'}://{hosts}"
        self._preferred = 0
        self._lock = threading.Lock()
        self._token: Optional[str] = None
        self._lease: Optional[Tuple[str, float]] = None  # (id, monotonic time granted)
        self._local = threading.local()

    def options(self) -> Dict[str, Any]:
        """The arguments that make an equal connection (for a clone)."""
        return dict(endpoints=self.endpoints, secure=self.secure, user=self.user, password=self.password,
                    ca_cert=self.ca_cert, cert=self.cert, key=self.key, request_s=self.request_s)

    def _client(self, index: int):
        clients = getattr(self._local, "clients", None)
        if clients is None:
            clients = self._local.clients = {}
        client = clients.get(index)
        if client is None:
            module, _ = _etcd3gw()
            host, port = self.endpoints[index]
            client = module.Etcd3Client(host=host, port=port, protocol="https" if self.secure else "http",
                                        ca_cert=self.ca_cert, cert_key=self.key, cert_cert=self.cert,
                                        api_path="/v3/")
            clients[index] = client
        return client

    def close(self) -> None:
        """Close this thread's HTTP sessions (other threads' close with them)."""
        for client in getattr(self._local, "clients", {}).values():
            client.session.close()
        self._local.clients = {}

    # ------------------------------------------------------------------ requests
    def call(self, path: str, payload: Dict[str, Any], deadline: float, what: str) -> Dict[str, Any]:
        """POST `payload` to `/v3/<path>` of a member that answers, before `deadline`.

        Arguments:
            path: gateway path, e.g. "kv/txn".
            payload: the request as the gateway's JSON.
            deadline: `time.monotonic()` value by which an answer must come.
            what: the store operation, for messages.

        Returns:
            the response's JSON.

        Raises:
            StoreUnavailable: no member answered by the deadline (each tried in turn).
            PermissionError: wrong credentials, or a permission the user lacks.
            StoreRefused: the cluster refused the request.
        """
        _, errors = _etcd3gw()
        last = "no attempt"
        relogged = False
        budget = max(deadline - time.monotonic(), 0.0)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreUnavailable(
                    f"the etcd store {self.name} did not answer {what} within {budget:.3g} s (last: {last}): its "
                    "members are down, unreachable or without a quorum", store=self.name, operation=what,
                    timeout_s=budget)
            index = self._preferred
            client = self._client(index)
            client.timeout = max(min(self.request_s, left), 0.001)
            headers = {}
            if self.user is not None and path != "auth/authenticate":
                headers["Authorization"] = self._login(deadline, what)
            try:
                return client.post(client.get_url(path), json=payload, headers=headers)
            except (errors.ConnectionFailedError, errors.ConnectionTimeoutError) as error:
                last = f"{self._endpoint(index)}: {type(error).__name__} {_detail(error)}"
            except errors.Etcd3Exception as error:
                code, message = _status(error)
                if code in (_UNAVAILABLE, _DEADLINE):
                    last = f"{self._endpoint(index)}: {message}"
                elif code == _UNAUTHENTICATED and self.user is not None and not relogged and path != "auth/authenticate":
                    relogged = True  # the token expired (or the member restarted): log in again, once
                    with self._lock:
                        self._token = None
                    continue
                elif code in (_UNAUTHENTICATED, _PERMISSION) or (path == "auth/authenticate" and code == _INVALID):
                    raise PermissionError(f"the etcd store {self.name} refused {what}: {message} (check the "
                                          "user:password@ or the client certificate given)") from None
                else:
                    raise StoreRefused(f"the etcd store {self.name} refused {what}: {message}") from None
            # This member did not answer: the next one (others may have moved on already).
            with self._lock:
                if self._preferred == index:
                    self._preferred = (index + 1) % len(self.endpoints)
            if self._preferred == 0 or len(self.endpoints) == 1:
                time.sleep(min(0.02, max(deadline - time.monotonic(), 0)))  # a full round failed: a breath

    @property
    def preferred(self) -> int:
        """The index of the endpoint requests go to first (the last one that answered)."""
        return self._preferred

    def token(self, deadline: float, what: str) -> str:
        """The login token (logging in when there is none); for requests made outside `call` (a watch)."""
        return self._login(deadline, what)

    def _endpoint(self, index: int) -> str:
        host, port = self.endpoints[index]
        return f"{host}:{port}"

    def _login(self, deadline: float, what: str) -> str:
        with self._lock:
            token = self._token
        if token is not None:
            return token
        reply = self.call("auth/authenticate", {"name": self.user, "password": self.password or ""}, deadline,
                          f"{what} (login of user {self.user!r})")
        with self._lock:
            self._token = reply["token"]
            return self._token

    def lease(self, deadline: float, what: str) -> str:
        """The id of a lease with at least half of `LEASE_TTL_S` left (granted when needed)."""
        with self._lock:
            found = self._lease
        if found is not None and time.monotonic() - found[1] < LEASE_TTL_S / 2:
            return found[0]
        reply = self.call("lease/grant", {"TTL": LEASE_TTL_S, "ID": 0}, deadline, what)
        with self._lock:
            self._lease = (str(reply["ID"]), time.monotonic())
            return self._lease[0]

    def forget_lease(self) -> None:
        """The lease is gone (the cluster said so): the next `lease()` grants a new one."""
        with self._lock:
            self._lease = None


def _detail(error) -> str:
    text = getattr(error, "detail_text", None) or str(error)
    return text[:200]


def _status(error) -> Tuple[Optional[int], str]:
    """(gRPC code, message) of a gateway error body (None, its text when it is not JSON)."""
    text = getattr(error, "detail_text", None) or ""
    try:
        body = json.loads(text)
        return int(body.get("code")), str(body.get("message") or body.get("error") or text)
    except (ValueError, TypeError):
        return None, (text or str(error))[:200]
