"""The KV switch's host work at serving scale: decoding the ranks' metadata and planning, against the reference.

Every rank of a switch decodes every rank's published page tables (`kv_meta.decode_meta`) and computes the same
plan (`kv_plan.Planner`) before anything moves, so at serving scale this is part of every switch's prepare phase.
This times both on synthetic states (`tests.kv_workloads.serving_metas`: `--requests` requests of `--tokens`
tokens, no sharing) against the one-page-at-a-time reference they replaced (tests/kv_plan_reference.py) in the
same run, best of `--repeat`, and checks that both give the same plan.

Prints `KVPLAN <what> R=<r> ...: ours <ms> reference <ms> (<x> faster)` per row.

Also the copy blocks of rank 0's TP->EP sends for a model of `--layers` layers and `--kv-heads` KV heads
(`kv_cache.move_blocks`) against the first version's (one block per move, layer and K/V), and every peer's blocks
of those sends built in one native pass over the whole plan (`kv_cache.peer_blocks`, the switch's KV phase) against
splitting the plan by peer and building each part.

Usage: python3 scripts/kv_plan_bench.py [--ranks R ...] [--requests N] [--tokens T] [--repeat K] [--layers L]
       [--kv-heads H]
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def best_ms(function, repeat: int) -> float:
    """The fastest of `repeat` calls of `function`, in milliseconds."""
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def rows(ranks: int, requests: int, tokens: int, repeat: int, layers: int = 32, heads: int = 8):
    """(what, ours ms, reference ms) for the decoding of every rank's metadata, both plans, and the copy blocks of
    rank 0's TP->EP sends (a model of `layers` layers, `heads` KV heads) at one shape."""
    import types

    from mooncake_ep_switch.layouts import EP, TP
    from mooncake_ep_switch.switch.kv_cache import KVCacheConfig, move_blocks, peer_blocks
    from mooncake_ep_switch.switch.kv_meta import decode_meta, encode_meta
    from mooncake_ep_switch.switch.kv_plan import Planner, moves_by_peer
    from tests.kv_plan_reference import ReferencePlanner, reference_decode_meta, reference_move_blocks
    from tests.kv_workloads import serving_metas

    out = []
    for source, target in ((TP, EP), (EP, TP)):
        metas, units = serving_metas(source, ranks, requests, tokens)
        config = KVCacheConfig(1, ranks, 8, 16, units)
        blobs = [encode_meta(meta, config) for meta in metas]
        if source == TP:  # every rank reads every rank's tables (the TP ones are the larger)
            out.append(("decode every rank's metadata",
                        best_ms(lambda: [decode_meta(blob, config, ranks) for blob in blobs], repeat),
                        best_ms(lambda: [reference_decode_meta(blob, config, ranks) for blob in blobs], repeat)))
        ours, reference = Planner(config, ranks, 0, source), ReferencePlanner(config, ranks, 0, source)
        got, want = ours.plan(metas, target), reference.plan(metas, target)
        assert not got.refused and np.array_equal(got.moves, want.moves) and got.owner == want.owner
        assert got.new_requests == want.new_requests
        out.append((f"plan {source}->{target} ({got.moves.shape[0]} moves)",
                    best_ms(lambda: ours.plan(metas, target), repeat),
                    best_ms(lambda: reference.plan(metas, target), repeat)))
        if source == TP:  # the copy blocks of what rank 0 sends (a page's every layer, K and V)
            model = KVCacheConfig(layers, heads, 128, 16, units)
            sends = got.moves[got.moves[:, 0] == 0]
            shape = types.SimpleNamespace(config=model, heads_per_unit=heads // ranks,
                                          unit_bytes=heads // ranks * 16 * 128 * 2)
            count = (move_blocks(model, ranks, sends, 0, 0).shape[0],
                     reference_move_blocks(shape, sends, 0, 0).shape[0])
            out.append((f"copy blocks of rank 0's {sends.shape[0]} sends, L={layers} H_kv={heads} "
                        f"({count[0]} blocks, reference {count[1]})",
                        best_ms(lambda: move_blocks(model, ranks, sends, 0, 0), repeat),
                        best_ms(lambda: reference_move_blocks(shape, sends, 0, 0), repeat)))
            # the switch's KV phase: every peer's blocks in one native pass over the plan, against splitting the
            # plan by peer and building each part (the phase before 2026-12-01); both from the whole plan
            bases, peers = [(rank + 1) << 40 for rank in range(ranks)], list(range(ranks))

            def split_then_build():
                parts = moves_by_peer(got.moves, 0, True, ranks)
                return [move_blocks(model, ranks, parts[peer], bases[0], bases[peer]) for peer in peers]

            one_pass = peer_blocks(model, ranks, got.moves, 0, peers, bases, True)
            assert np.array_equal(one_pass[0], np.concatenate(split_then_build()))
            out.append((f"every peer's copy blocks of rank 0's sends from the plan ({one_pass[0].shape[0]} blocks; "
                        "reference: split by peer, then each part's)",
                        best_ms(lambda: peer_blocks(model, ranks, got.moves, 0, peers, bases, True), repeat),
                        best_ms(split_then_build, repeat)))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--layers", type=int, default=32, help="layers of the model whose copy blocks are timed")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads of that model (a multiple of every R)")
    args = parser.parse_args(argv)
    for ranks in args.ranks:
        pages = args.requests * -(-args.tokens // 16)
        for what, ours, reference in rows(ranks, args.requests, args.tokens, args.repeat, args.layers, args.kv_heads):
            print(f"KVPLAN {what} R={ranks} {args.requests} requests x {args.tokens} tokens ({pages} pages of 16): "
                  f"ours {ours:.1f} ms reference {reference:.1f} ms ({reference / ours:.1f}x faster)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
