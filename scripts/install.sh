#!/usr/bin/env bash
# Install everything mooncake_ep_switch needs on a fresh Debian machine (CPU host), from this repo.
#  1. Debian's libibverbs1: the Mooncake Transfer Engine wheel links it even without RDMA NICs.
#  2. Debian's etcd-server (etcd 3.4): the etcd store's tests and `--store etcd` start local clusters of it;
#     no system etcd service is started (a policy-rc.d that denies starts is in place during the install).
#  3. torch, pinned first: an unpinned torch with none installed pulls a multi-GB CUDA build.
#  4. this package with its test, Mooncake (non-CUDA), plot, models (transformers) and etcd (etcd3gw) extras,
#     building the native extension.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo
missing=()
ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 || missing+=(libibverbs1)
command -v etcd >/dev/null || missing+=(etcd-server)
if [ ${#missing[@]} -gt 0 ]; then
  # Deny service starts while installing (etcd-server's postinst would start a system etcd on :2379),
  # unless a policy is already in place; removed again afterwards.
  own_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
    $SUDO chmod +x /usr/sbin/policy-rc.d
    own_policy=1
  fi
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  if [ "$own_policy" = 1 ]; then $SUDO rm -f /usr/sbin/policy-rc.d; fi
  # The package enables a system etcd service (on :2379, at the next boot): disable it (and stop it, should
  # systemd have started it anyway); the etcd store's clusters are started per job.
  if command -v systemctl >/dev/null; then
    $SUDO systemctl disable --now etcd >/dev/null 2>&1 || true
  fi
fi
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test,mooncake,plot,models,etcd]"
