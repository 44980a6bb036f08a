"""`mooncake-ep demo --model NAME`: a tiny transformers MoE model generating greedily on local CPU ranks.

Prefill and first decode step in EP, a switch to TP for two steps and back, an EPLB rebalance of
the redundant experts from the router's loads (committed while decoding), and every step's logits
and tokens checked against the single-process transformers model.
"""
import sys

from mooncake_ep_switch.models.serve import ServeConfig, reference_generation, serve_generation
from mooncake_ep_switch.reference.compare import GreedyComparison, calc_diff

CHECK_LIMIT = 1e-3  # calc_diff of the logits against the single-process model (bf16 model)


def run_model_demo(model: str, num_ranks: int = 4, transport: str = "host", stream=sys.stdout) -> bool:
    """Serve `model` on `num_ranks` ranks, print every step's check and tokens/s per layout.

    Arguments:
        model: architecture name (`models.tiny.ARCHITECTURES`).
        num_ranks: local CPU ranks (2, 4 or 8: they must divide the 8 experts).
        transport: the Buffer transport.
        stream: where the lines go.

    Returns:
        correct: True when every step's logits are within `CHECK_LIMIT` and the tokens are the same (a
            sequence may take the other token of a near-tie of the reference's logits, as another
            CPU's kernels may: `reference.compare.GreedyComparison`; it is not compared after that).
    """
    config = ServeConfig(model=model, num_ranks=num_ranks, transport=transport, new_tokens=12,
                         switches=((2, "tp"), (4, "ep")), rebalance_step=5)
    print(f"mooncake_ep_switch demo --model {model}: {num_ranks} CPU ranks, {config.sequences_per_rank} sequences "
          f"per rank, prompt {config.prompt_len} tokens, {config.new_tokens} greedy steps, {config.num_experts} "
          f"experts, {config.redundant_per_rank} redundant expert(s) per rank", file=stream)
    result = serve_generation(config)
    reference = reference_generation(config)
    correct = True
    per_layout = {}
    greedy = GreedyComparison()
    for step in result["steps"]:
        expected = reference[step["step"]]
        kept, wrong = greedy.step(step["step"], step["rows"], step["tokens"], expected["logits"], expected["tokens"])
        diff = calc_diff(step["logits"][kept], expected["logits"][[step["rows"][i] for i in kept]]) if kept else 0.0
        same = not wrong
        correct = correct and diff < CHECK_LIMIT and same and bool(kept)
        ties = sorted(row for row, at in greedy.diverged.items() if at == step["step"])
        tokens = len(step["rows"]) * (config.prompt_len if step["step"] == 0 else 1)
        if step["step"]:
            seconds, count = per_layout.get(step["layout"], (0.0, 0))
            per_layout[step["layout"]] = (seconds + step["seconds"], count + tokens)
        events = ", ".join(f"EPLB {r['outcome']} layers {r['layers']}" for r in step["reports"])
        print(f"  step {step['step']:2d}  {step['layout'].upper()}  {tokens:3d} tokens  {step['seconds'] * 1e3:6.1f} ms  "
              f"calc_diff {diff:.1e}  tokens {'same' if same else 'DIFFERENT'}"
              f"{f' (near-tie: sequences {ties} took the other token)' if ties else ''}  {events}", file=stream)
    for switch in result["switches"]:
        print(f"  switch               before step {switch['step']}: -> {switch['target'].upper()} in "
              f"{switch['ms']:.1f} ms", file=stream)
    if result["rebalance"] is not None:
        print(f"  EPLB rebalance       planned at step 5 from the router's loads: {result['rebalance']['changed_layers']} "
              f"layer(s) changed; placement now {result['phy2log']['final']}", file=stream)
    for layout, (seconds, count) in sorted(per_layout.items()):
        print(f"  decode {layout.upper()}            {count / seconds:8.0f} tokens/s ({count} tokens)", file=stream)
    print(f"  checks               every step's logits vs the single-process transformers model (calc_diff < "
          f"{CHECK_LIMIT:.0e}) and the same greedy tokens: {'PASS' if correct else 'FAIL'}", file=stream)
    return correct
