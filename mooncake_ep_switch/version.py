"""The package's version and the peer APIs it mirrors (one place: setup.py, `--version` and the README read it)."""

VERSION = "0.2.0"
__version__ = VERSION  # the conventional name (re-exported by the package)

# What "drop-in" means for this release: the peer APIs whose callers run unchanged against ours.
MIRRORS = (
    ("Mooncake EP", "Buffer and ElasticBuffer of mooncake-transfer-engine 0.3.13"),
    ("DeepEP V1", "the low-latency deep_ep.Buffer (DeepEP 1.x)"),
    ("DeepEP V2", "deep_ep.ElasticBuffer (DeepEP 2.x)"),
)


def version_line() -> str:
    """One line for `--version`: this package's version and the APIs it mirrors.

    Returns:
        line: str, e.g. "mooncake_ep_switch 0.2.0 (mirrors Mooncake EP: ...; DeepEP V1: ...; DeepEP V2: ...)".
    """
    mirrored = "; ".join(f"{name}: {what}" for name, what in MIRRORS)
    return f"mooncake_ep_switch {VERSION} (mirrors {mirrored})"
