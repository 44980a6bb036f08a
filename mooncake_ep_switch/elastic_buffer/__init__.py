"""DeepEP V2's `ElasticBuffer` API (dispatch/combine with V2's layouts) on this runtime's fault-tolerant
`Buffer`: `rows.py` (the byte rows and the inner routing), `layout.py` (V2's receive layouts),
`handle.py` (`EPHandle`), `buffer.py` (`ElasticBuffer`)."""
from mooncake_ep_switch.elastic_buffer.buffer import ElasticBuffer
from mooncake_ep_switch.elastic_buffer.handle import EPHandle

__all__ = ["ElasticBuffer", "EPHandle"]
