#!/usr/bin/env bash
# Print the Debian mirror URL to debootstrap from: $MIRROR if set, else the first Debian archive this host's apt
# already uses (deb822 /etc/apt/sources.list.d/*.sources "URIs:", or one-line "deb URL ..." entries), so no
# script of this repository has to name a download host. Exit 1 with a hint when none is found.
set -euo pipefail
if [ -n "${MIRROR:-}" ]; then echo "$MIRROR"; exit 0; fi
shopt -s nullglob
for f in /etc/apt/sources.list.d/*.sources; do
  uri=$(awk '/^URIs:/ { for (i = 2; i <= NF; i++) if ($i ~ /\/debian\/?$/) { print $i; exit } }' "$f")
  if [ -n "$uri" ]; then echo "${uri%/}"; exit 0; fi
done
for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
  [ -f "$f" ] || continue
  uri=$(awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\/.*\/debian\/?$/) { print $i; exit } }' "$f")
  if [ -n "$uri" ]; then echo "${uri%/}"; exit 0; fi
done
echo "debian-mirror: no Debian archive in this host's apt sources; set MIRROR=<your Debian mirror URL>" >&2
exit 1
