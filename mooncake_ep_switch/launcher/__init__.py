"""Local launching, apart from the runtime: `launch.py` (`LocalCluster`: rank processes on this machine,
optionally in network namespaces as pretend hosts) and `namespaces.py` (entering a namespace).
Benchmarks, the demo and the tests start ranks with it; the runtime itself never does."""
