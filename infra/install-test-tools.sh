#!/usr/bin/env bash
# The system tools the test suite runs for real (sshd, headless chromium + chromedriver, Prometheus), from Debian:
# only what is missing, in one `apt-get update` and one install, without the packages they merely recommend.
# Recommends were 107 of the 153 packages a fresh machine got (avahi, cups, udev, samba, IPMI and SMART tools,
# prometheus-node-exporter...), none of which a test uses; chromium's fonts (fonts-liberation) are a dependency.
set -euo pipefail

missing=()
command -v sshd >/dev/null || test -x /usr/sbin/sshd || missing+=(openssh-server openssl)
test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || missing+=(chromium chromium-driver)
command -v prometheus >/dev/null || missing+=(prometheus)
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
echo "installing ${missing[*]} (apt, without recommends)"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
