"""Entry points, apart from the runtime: the command line (`cli.py`, run by `python -m mooncake_ep_switch`
and `mooncake-ep`), the demo and its timeline plot, the CUDA demo and the switching simulator's CLI.
Nothing in the runtime imports this package."""
