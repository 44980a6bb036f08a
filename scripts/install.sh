#!/usr/bin/env bash
# Install everything mooncake_ep_switch needs on a fresh Debian machine (CPU host), from this repo.
#  1. Debian's libibverbs1: the Mooncake Transfer Engine wheel links it even without RDMA NICs.
#  2. torch, pinned first: an unpinned torch with none installed pulls a multi-GB CUDA build.
#  3. this package with its test, Mooncake (non-CUDA), plot and models (transformers) extras, building the native extension.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null
  else
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null
  fi
fi
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test,mooncake,plot,models]"
