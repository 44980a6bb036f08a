"""`KeyPrefix`: torch's `PrefixStore` in Python, so every operation reaches a Python store's own method.

torch's `dist.PrefixStore` is C++; over a store written in Python (`BoundedStore`, `EtcdStore`) it
calls the inner store through torch's trampoline, which forwards set/get/add/compare_set/check/wait/
multi_get/multi_set/append but not `deleteKey` or `getNumKeys`: those raise "Tried to call pure
virtual function". The ballots delete the keys of epochs a ring slot forgets, so over a
`PrefixStore` the 256th EPLB chunk epoch (or switch) raised. `KeyPrefix` keeps the same key names
(`"<prefix>/<key>"`) and calls the inner store from Python. gloo's rendezvous keeps torch's
`PrefixStore` (it uses only forwarded operations).
"""
from datetime import timedelta
from typing import List, Optional

import torch.distributed as dist


class KeyPrefix(dist.Store):
    """Keys of `store` under `prefix` (`"<prefix>/<key>"`, as `dist.PrefixStore(prefix, store)` names them).

    Arguments:
        prefix: the folder, e.g. `"eplb/3"`.
        store: the inner `torch.distributed.Store` (C++ or Python).
    """

    def __init__(self, prefix: str, store):
        super().__init__()
        self.prefix = prefix
        self.inner = store
        timeout = getattr(store, "timeout", None)
        if timeout is not None:  # what torch's PrefixStore reports too (gloo reads it through further prefixes)
            self.set_timeout(timeout)

    @property
    def underlying_store(self):
        """The inner store (the attribute's name in torch's PrefixStore)."""
        return self.inner

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def set(self, key: str, value) -> None:
        self.inner.set(self._key(key), value)

    def get(self, key: str) -> bytes:
        return self.inner.get(self._key(key))

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(self._key(key), amount)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self.inner.compare_set(self._key(key), expected, desired)

    def check(self, keys: List[str]) -> bool:
        return self.inner.check([self._key(key) for key in keys])

    def wait(self, keys: List[str], timeout: Optional[timedelta] = None) -> None:
        if timeout is None:
            self.inner.wait([self._key(key) for key in keys])
        else:
            self.inner.wait([self._key(key) for key in keys], timeout)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(self._key(key))

    def multi_get(self, keys: List[str]) -> List[bytes]:
        return self.inner.multi_get([self._key(key) for key in keys])

    def multi_set(self, keys: List[str], values) -> None:
        self.inner.multi_set([self._key(key) for key in keys], values)

    def append(self, key: str, value) -> None:
        self.inner.append(self._key(key), value)

    def num_keys(self) -> int:
        return self.inner.num_keys()
