#!/usr/bin/env bash
# The system tools the test suite runs for real (sshd, headless chromium + chromedriver, Prometheus), from Debian:
# only what is missing, in one `apt-get update` and one install, without the packages they merely recommend.
# Recommends were 107 of the 153 packages a fresh machine got (avahi, cups, udev, samba, IPMI and SMART tools,
# prometheus-node-exporter...), none of which a test uses. fonts-liberation is one of them, but the browser tests
# need it: Arial's metrics, which MLflow's font stack falls back to on Linux (without it chromium draws DejaVu Sans,
# ~10% wider, and the runs table's headline headers are cut: chromium 156 on a fresh Debian 12 machine).
set -euo pipefail

missing=()
command -v sshd >/dev/null || test -x /usr/sbin/sshd || missing+=(openssh-server openssl)
test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || missing+=(chromium chromium-driver)
test -f /usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf || missing+=(fonts-liberation)
command -v prometheus >/dev/null || missing+=(prometheus)
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
echo "installing ${missing[*]} (apt, without recommends)"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
