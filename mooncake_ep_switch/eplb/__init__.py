"""Expert-parallel load balancing: placement, load recorder, dispatch maps, online rebalance."""
