"""Every environment variable the runtime reads, read in this one place.

Settings are an immutable NamedTuple; `settings()` reads the environment once per call so that
tests and spawned ranks can set variables before they construct a Buffer.
"""
import hashlib
import os
import secrets
import socket
from typing import Mapping, NamedTuple, Optional


class Settings(NamedTuple):
    """Process-wide runtime settings.

    Fields:
        host_id: identity used to decide which peers share this host (shared memory reaches
            them). Default: hostname + the machine id + the boot id, so two containers with the
            same hostname are not mistaken for one host. Override: `MEP_HOST_ID`.
        bind_host: address the Transfer Engine advertises to peers. Default 127.0.0.1. The engine
            itself listens on all interfaces whatever this says (hard-coded in the engine).
            Override: `MEP_BIND_HOST`.
        te_protocol: Transfer Engine protocol, "tcp" or "rdma". Default: "rdma" when an RDMA
            device is present under /sys/class/infiniband, else "tcp". Override:
            `MEP_TE_PROTOCOL`.
        connect_timeout_s: deadline for connection set-up and metadata exchange.
            Override: `MEP_CONNECT_TIMEOUT_S` (default 60).
        fault_point: test-only fault injection point name (`MEP_FAULT_POINT`), or None.
        job_secret: per-job secret (bytes) that authenticates every membership record in the store
            (HMAC-SHA256), or None: records are then only validated, and anyone who can write the
            store can forge them. The launcher generates one and passes it to every rank and
            replacement; it is never written to the store. `MEP_JOB_SECRET` (at least 16
            characters; unset or empty: None).
        cuda_check_values: on the `"cuda"` transport, check the values of `topk_idx` and
            `active_ranks` on the device in eager calls, which costs one host synchronisation
            per call (never inside CUDA graph capture, where they are not checked). Default on;
            `MEP_CUDA_CHECK_VALUES=0` turns it off (the kernels still skip out-of-range ids).
        cuda_fused_kernels: on the `"cuda"` transport, launch the fused dispatch/combine kernels (8
            launches a round trip instead of 12-13: the signals from the row kernels' last block, the
            layout from the waits' last block, the call word and quantization in the ranking launch);
            outputs are the same bits. Default off until a GPU run has verified them
            (`scripts/gpu_check.sh`); `MEP_CUDA_FUSED_KERNELS=1` turns it on.
    """

    host_id: str
    bind_host: str
    te_protocol: str
    connect_timeout_s: float
    fault_point: Optional[str]
    job_secret: Optional[bytes] = None
    cuda_check_values: bool = True
    cuda_fused_kernels: bool = False


def _read_first_line(path: str) -> str:
    try:
        with open(path, "r", encoding="ascii", errors="replace") as handle:
            return handle.readline().strip()
    except OSError:
        return ""


def default_host_id() -> str:
    """Identity of this host: hostname, machine id and boot id joined by '/'.

    Returns:
        host_id: str `"<hostname>/<machine id>/<boot id>"` (an unreadable id is left empty).
    """
    machine = _read_first_line("/etc/machine-id") or _read_first_line("/var/lib/dbus/machine-id")
    boot = _read_first_line("/proc/sys/kernel/random/boot_id")
    return "/".join([socket.gethostname(), machine, boot])


def _default_te_protocol() -> str:
    try:
        return "rdma" if os.listdir("/sys/class/infiniband") else "tcp"
    except OSError:
        return "tcp"


def settings() -> Settings:
    """Read the runtime settings from the environment.

    Returns:
        settings: a `Settings` tuple.
    """
    env = os.environ
    protocol = env.get("MEP_TE_PROTOCOL", "") or _default_te_protocol()
    if protocol not in ("tcp", "rdma"):
        raise ValueError(f"MEP_TE_PROTOCOL: expected 'tcp' or 'rdma', got {protocol!r}")
    timeout_text = env.get("MEP_CONNECT_TIMEOUT_S", "60")
    try:
        connect_timeout_s = float(timeout_text)
    except ValueError:
        raise ValueError(f"MEP_CONNECT_TIMEOUT_S: expected a number of seconds, got {timeout_text!r}") from None
    if connect_timeout_s <= 0:
        raise ValueError(f"MEP_CONNECT_TIMEOUT_S: expected > 0, got {connect_timeout_s}")
    secret = env.get("MEP_JOB_SECRET", "")
    if secret and len(secret) < 16:
        raise ValueError(f"MEP_JOB_SECRET: expected at least 16 characters, got {len(secret)}")
    return Settings(
        host_id=env.get("MEP_HOST_ID", "") or default_host_id(),
        bind_host=env.get("MEP_BIND_HOST", "") or "127.0.0.1",
        te_protocol=protocol,
        connect_timeout_s=connect_timeout_s,
        fault_point=env.get("MEP_FAULT_POINT") or None,
        job_secret=secret.encode() if secret else None,
        cuda_check_values=_flag(env, "MEP_CUDA_CHECK_VALUES", True),
        cuda_fused_kernels=_flag(env, "MEP_CUDA_FUSED_KERNELS", False),
    )


def _flag(env, name: str, default: bool) -> bool:
    """A boolean environment setting: "1"/"0" (unset or empty: `default`)."""
    text = env.get(name, "")
    if text == "":
        return default
    if text not in ("0", "1"):
        raise ValueError(f"{name}: expected '0' or '1', got {text!r}")
    return text == "1"


JOB_SECRET_ENV = "MEP_JOB_SECRET"
# Names a launcher writes into a rank's environment before the rank reads its settings.
HOST_ID_ENV = "MEP_HOST_ID"
BIND_HOST_ENV = "MEP_BIND_HOST"
# Read by torch's gloo (never by this package): the interface gloo's sockets bind to. Without it
# gloo binds the address the hostname resolves to, or loopback when that address is not local (as in
# a network namespace), and peers in other namespaces could not reach it.
GLOO_SOCKET_IFNAME_ENV = "GLOO_SOCKET_IFNAME"


def new_job_secret() -> str:
    """A fresh per-job secret for `MEP_JOB_SECRET` (what a launcher passes to every rank).

    Returns:
        secret: str, 64 hex digits (256 random bits).
    """
    return secrets.token_hex(32)


def etcd_job_id(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The job's identity on an etcd store's prefix (`store/connect.py`): `MEP_JOB_ID`, else a digest
    of `MEP_JOB_SECRET` (never the secret itself; a replacement inherits it), else None.

    Arguments:
        environ: the variables to read (default this process's; a launcher passes its ranks').

    Returns:
        job: str, or None.
    """
    environ = os.environ if environ is None else environ
    if environ.get("MEP_JOB_ID"):
        return environ["MEP_JOB_ID"]
    secret = environ.get("MEP_JOB_SECRET", "")
    if secret:
        return "secret-" + hashlib.sha256(b"mep-etcd-owner\0" + secret.encode()).hexdigest()[:16]
    return None


# How long the Transfer Engine's TCP transport lets one transfer make no progress (or wait for its
# status frame) before it fails it. The engine's own default is 30 s, and its destructor waits for
# such a transfer: a survivor's Buffer.destroy() after a peer host's death took just over 30 s
# (issue 28 item 1). A few seconds also reaps writes abandoned at a round's deadline sooner.
# `MC_TCP_PROGRESS_TIMEOUT_SEC` / `MC_TCP_STATUS_TIMEOUT_SEC`, where the user set them, win.
TE_TCP_STALL_TIMEOUT_S = 5

# How many TCP connections ("lanes") the Transfer Engine's TCP transport opens to one peer. Its default
# is 4, opened lazily: a Buffer's construction proves one data connection per peer (a real probe
# write), and the first dispatch/combine, which writes several ranges per peer at once, then opened
# up to three more inside the call. Under CPU contention one write on such a fresh connection now and
# then got no status frame for 4-5 s (a whole call's deadline), the writer masked a live peer, and
# tests/test_hosts_resize.py's 5 -> 4 -> 6 grow failed 4 runs in 52 (issue 43). With one lane every
# call uses the connection the probe proved: 0 failures in 49 runs under the same load. A round writes
# a few ranges per peer; docs/benchmarks.md ("Across hosts") measures both settings.
# `MC_TCP_LANES_PER_PEER`, where the user set it, wins.
TE_TCP_LANES_PER_PEER = 1


def set_transfer_engine_defaults(tcp_stall_timeout_s: Optional[int] = None, log_level: Optional[str] = None,
                                 tcp_lanes_per_peer: Optional[int] = None) -> None:
    """Set the Mooncake Transfer Engine's own environment variables before an engine starts (the one place they are written).

    The engine reads `MC_*` variables when it starts; a value the user already set wins.

    Arguments:
        tcp_stall_timeout_s: seconds after which the engine's TCP transport fails a stalled
            transfer (`MC_TCP_PROGRESS_TIMEOUT_SEC`, `MC_TCP_STATUS_TIMEOUT_SEC`), or None.
        log_level: the engine's log level (`MC_LOG_LEVEL`: "INFO", "WARNING", "ERROR"), or None.
        tcp_lanes_per_peer: TCP connections the engine's TCP transport opens to one peer
            (`MC_TCP_LANES_PER_PEER`), or None.
    """
    if tcp_stall_timeout_s is not None:
        os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(tcp_stall_timeout_s))
        os.environ.setdefault("MC_TCP_STATUS_TIMEOUT_SEC", str(tcp_stall_timeout_s))
    if log_level is not None:
        os.environ.setdefault("MC_LOG_LEVEL", str(log_level))
    if tcp_lanes_per_peer is not None:
        os.environ.setdefault("MC_TCP_LANES_PER_PEER", str(tcp_lanes_per_peer))
