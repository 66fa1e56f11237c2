#!/usr/bin/env bash
# Installs the system packages AstraFlow needs that pip cannot provide, only those missing.
#
#   bubblewrap (bwrap): the code sandbox's isolation (astraflow/sandbox); without it the sandbox
#                       refuses to run untrusted code unless ASTRAFLOW__SANDBOX__ALLOW_WEAK_ISOLATION=true
#   chromium:           headless browser of the dashboard's test (tests/integration/test_dashboard.py)
#   golang-go (go):     builds Toxiproxy, the simulated WAN of `astraflow wan up` and bench/regions.py
#                       (skipped when /usr/local/go/bin/go exists)
#
# Called by scripts/test.sh and scripts/demo.sh. As root on Debian/Ubuntu it runs `apt-get update`
# and `apt-get install`; otherwise it says what to install and goes on (exit 0), so the rest of
# the setup still runs.
set -euo pipefail

# command that must exist -> Debian package that provides it
declare -A NEEDED=([bwrap]=bubblewrap [chromium]=chromium)

missing=()
for cmd in "${!NEEDED[@]}"; do
  command -v "$cmd" >/dev/null 2>&1 || missing+=("${NEEDED[$cmd]}")
done
if ! command -v go >/dev/null 2>&1 && [ ! -x /usr/local/go/bin/go ]; then
  missing+=(golang-go)
fi
[ "${#missing[@]}" -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
  echo "[system-deps] missing: ${missing[*]}. Install as root: apt-get install -y ${missing[*]}" \
    "(the code sandbox refuses to run without bubblewrap; the dashboard test skips without chromium)" >&2
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "[system-deps] missing: ${missing[*]}, and no apt-get here: install them with this system's" \
    "package manager (the code sandbox refuses to run without bubblewrap; the dashboard test skips without chromium)" >&2
  exit 0
fi
echo "[system-deps] installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >&2
apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
