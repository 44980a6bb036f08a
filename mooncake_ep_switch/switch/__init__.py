"""Runtime TP<->EP layout switching: unified weight memory, reshard, KV redistribution, policy."""
