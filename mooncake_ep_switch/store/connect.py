"""Open an `EtcdStore` from an `etcd://` URL: check the input, reach the cluster, claim the job's prefix.

    etcd://[user:password@]host:port[,host:port...]/prefix[?job=ID&ca=FILE&cert=FILE&key=FILE&request_s=S]
    etcds://...   (HTTPS to the members)

`request_s` (default 3): the longest wait for one member's answer before the next member is asked.

Every check comes before the only write (the prefix's owner record, created if absent in one
transaction), so a refused connection leaves the cluster as it was. The job's identity is `job`
(argument, or `?job=`), else `MEP_JOB_ID`, else a digest of `MEP_JOB_SECRET` (the launcher's per-job
secret, which a replacement inherits); a prefix whose owner record names another job is refused.
Without any identity the prefix is only checked against a job that has one (documented: such
jobs must pick distinct prefixes themselves).
"""
import os
import re
import time
import urllib.parse
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

from mooncake_ep_switch.config import etcd_job_id
from mooncake_ep_switch.store.etcd_client import EtcdConnection, b64, unb64
from mooncake_ep_switch.store.etcd_store import EtcdStore

__all__ = ["EtcdUrl", "connect_etcd", "is_etcd_url", "parse_etcd_url"]

_PREFIX = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")
_QUERY = ("job", "ca", "cert", "key", "request_s")
_FORM = "etcd://[user:password@]host:port[,host:port...]/prefix[?job=&ca=&cert=&key=]"


class EtcdUrl:
    """A parsed `etcd://` URL (see `parse_etcd_url`)."""

    def __init__(self, endpoints: List[Tuple[str, int]], prefix: str, secure: bool, user: Optional[str],
                 password: Optional[str], options: Dict[str, str]):
        self.endpoints, self.prefix, self.secure = endpoints, prefix, secure
        self.user, self.password, self.options = user, password, options


def is_etcd_url(text) -> bool:
    """True when `text` is a str naming an etcd store (`etcd://` or `etcds://`)."""
    return isinstance(text, str) and text.split("://", 1)[0].lower() in ("etcd", "etcds") and "://" in text


def parse_etcd_url(url: str, argument: str = "url") -> EtcdUrl:
    """Split an etcd store URL into endpoints, prefix, credentials and options.

    Arguments:
        url: the URL (form above).
        argument: the caller's argument name, for messages.

    Returns:
        an `EtcdUrl`.

    Raises:
        ValueError: not of that form (the message says which part).
    """
    def bad(why: str) -> ValueError:
        shown = re.sub(r"(//[^:/@]*:)[^@/]*@", r"\1***@", url)  # never echo a password
        return ValueError(f"{argument}: expected an etcd URL {_FORM}, got {shown!r}: {why}")

    if not is_etcd_url(url):
        raise bad("the scheme must be etcd:// or etcds://")
    scheme, rest = url.split("://", 1)
    rest, _, query = rest.partition("?")
    authority, slash, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    if not slash or not prefix:
        raise bad("no key prefix (the job's, after the hosts: etcd://host:2379/myjob)")
    if not _PREFIX.match(prefix):
        raise bad(f"the prefix {prefix!r} may only hold letters, digits, '_', '.', '-' and single '/'")
    user = password = None
    if "@" in authority:
        credentials, _, authority = authority.rpartition("@")
        user, colon, password = credentials.partition(":")
        user, password = urllib.parse.unquote(user), urllib.parse.unquote(password)
        if not user or not colon:
            raise bad("credentials must be user:password@")
    endpoints = []
    for part in authority.split(","):
        found = _HOST.match(part.strip())
        if not found or not 0 < int(found.group(2)) < 65536:
            raise bad(f"{part!r} is not host:port")
        endpoints.append((found.group(1).strip("[]"), int(found.group(2))))
    if len(set(endpoints)) != len(endpoints):
        raise bad("an endpoint is named twice")
    options: Dict[str, str] = {}
    for name, values in urllib.parse.parse_qs(query, keep_blank_values=True, strict_parsing=False).items():
        if name not in _QUERY:
            raise bad(f"unknown option {name!r} (known: {', '.join(_QUERY)})")
        if len(values) != 1 or not values[0]:
            raise bad(f"option {name!r} needs one non-empty value")
        options[name] = values[0]
    return EtcdUrl(endpoints, prefix, scheme.lower() == "etcds", user, password, options)


def _job_id(job: Optional[str]) -> Optional[str]:
    return job if job else etcd_job_id()


def connect_etcd(url: str, timeout_s: float = 60.0, *, user: Optional[str] = None, password: Optional[str] = None,
                 ca_cert: Optional[str] = None, cert: Optional[str] = None, key: Optional[str] = None,
                 job: Optional[str] = None, argument: str = "url") -> EtcdStore:
    """Open an `EtcdStore` on the cluster and prefix that `url` names, claiming the prefix for the job.

    Arguments:
        url: `etcd://[user:password@]host:port[,host:port...]/prefix[?job=&ca=&cert=&key=]`.
        timeout_s: deadline for reaching the cluster, and each operation's default timeout.
        user, password: credentials (instead of the URL's user:password@).
        ca_cert, cert, key: CA bundle, client certificate and key files (instead of `?ca=&cert=&key=`).
        job: the job's identity (instead of `?job=`; default from `MEP_JOB_ID` or `MEP_JOB_SECRET`).
        argument: the caller's argument name, for messages.

    Returns:
        store: an `EtcdStore`.

    Raises:
        ValueError: a malformed URL, conflicting or incomplete options, or a prefix another job owns.
        FileNotFoundError: a certificate file that does not exist.
        StoreUnavailable: no member answered within `timeout_s`.
        PermissionError: the cluster refused the credentials or certificate.
    """
    parsed = parse_etcd_url(url, argument)
    options = parsed.options
    for name, given, in_url in (("user", user, parsed.user), ("ca_cert", ca_cert, options.get("ca")),
                                ("cert", cert, options.get("cert")), ("key", key, options.get("key")),
                                ("job", job, options.get("job"))):
        if given is not None and in_url is not None:
            raise ValueError(f"{name}: given both as an argument and in {argument}; give it once")
    user = user if user is not None else parsed.user
    password = password if password is not None else parsed.password
    if (user is None) != (password is None):
        raise ValueError(f"user, password: give both or neither (got user={user!r}, a password: {password is not None})")
    ca_cert = ca_cert if ca_cert is not None else options.get("ca")
    cert = cert if cert is not None else options.get("cert")
    key = key if key is not None else options.get("key")
    if (cert is None) != (key is None):
        raise ValueError("cert, key: a client certificate needs both its certificate and its key file")
    for name, path in (("ca_cert", ca_cert), ("cert", cert), ("key", key)):
        if path is not None and not os.path.isfile(path):
            raise FileNotFoundError(f"{name}: no such file {path!r}")
    if (ca_cert or cert) and not parsed.secure:
        raise ValueError(f"{argument}: certificates need HTTPS: use etcds:// instead of etcd://")
    try:
        request_s = float(options.get("request_s", 3.0))
    except ValueError:
        request_s = float("nan")
    if not 0 < request_s < float("inf"):
        raise ValueError(f"{argument}: option request_s: expected a number of seconds > 0, got {options['request_s']!r}")
    connection = EtcdConnection(parsed.endpoints, parsed.secure, user, password, ca_cert, cert, key, request_s)
    store = EtcdStore(connection, parsed.prefix, timedelta(seconds=timeout_s))
    _claim(store, _job_id(job if job is not None else options.get("job")), time.monotonic() + timeout_s, argument)
    return store


def _claim(store: EtcdStore, job: Optional[str], deadline: float, argument: str) -> None:
    """Create the prefix's owner record for `job` if absent; refuse a prefix another job owns."""
    owner = b64(store.owner_key)
    read = [{"request_range": {"key": owner}}]
    if job is None:  # nothing to claim with: only reach the cluster (a read) and check the owner
        reply = store.connection.call("kv/txn", {"compare": [], "success": read, "failure": []}, deadline,
                                      "connect")
    else:
        reply = store.connection.call("kv/txn", {
            "compare": [{"key": owner, "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
            "success": [{"request_put": {"key": owner, "value": b64(job)}}], "failure": read}, deadline, "connect")
        if reply.get("succeeded"):
            return
    kvs = reply["responses"][0].get("response_range", {}).get("kvs") or []
    current = unb64(kvs[0].get("value")).decode(errors="replace") if kvs else None
    if current is not None and current != job:
        raise ValueError(f"{argument}: the prefix {store.prefix!r} of {store.connection.name} is used by another job "
                         f"({current!r}; this one is {job!r}): pick another prefix, or delete the old job's keys "
                         f"(everything under '{store.prefix}/') if it is over")
