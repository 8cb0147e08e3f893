#!/usr/bin/env bash
# Put promtool (tests/deploy) into .tools/bin, once: it is not on PyPI, so take the one binary
# out of Debian's prometheus package. .tools/ ignores itself. Exits non-zero if it cannot.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .tools/bin/promtool ] || command -v promtool >/dev/null; then exit 0; fi
command -v apt-get >/dev/null || { echo "install-promtool: no apt-get here" >&2; exit 1; }
mkdir -p .tools/bin
echo '*' >.tools/.gitignore
deb_dir="$(mktemp -d)"
trap 'rm -rf "$deb_dir"' EXIT
chown _apt "$deb_dir" 2>/dev/null || chmod 777 "$deb_dir"
(cd "$deb_dir" && { apt-get download -qq prometheus 2>/dev/null \
    || { apt-get update -qq && apt-get download -qq prometheus; }; })
dpkg-deb --fsys-tarfile "$deb_dir"/prometheus_*.deb \
    | tar -xO ./usr/bin/promtool >.tools/bin/promtool.part
chmod 755 .tools/bin/promtool.part
mv .tools/bin/promtool.part .tools/bin/promtool
