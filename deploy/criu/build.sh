#!/usr/bin/env bash
# CRIU >= 4.1 for ember's snapshots (Debian bookworm's 3.17 cannot dump on kernels from 6.13: their vDSO has a
# [vvar_vclock] area it does not know). Built from Debian trixie's source package, the upstream tarball pinned by
# its sha256, with bookworm's build packages; the binary is cached under ~/.cache/ember/criu/VERSION and copied to
# DEST (default .venv/bin/criu). About 30 s to build on 2 cores, once; later runs copy the cached binary.
# Needs root (apt-get for the build packages); without it, or if a step fails, it says why and exits 0:
# ember then runs without snapshots (`ember env status` says so).
set -euo pipefail
VERSION=4.1.1
SHA256=f80a66cb3726bb2116266d4759ce3bcbfab7abdb6b6d430bf20dd41911717afe
DEST=${1:-.venv/bin/criu}
CACHE=${EMBER_CRIU_CACHE:-$HOME/.cache/ember/criu/$VERSION}
say() { echo "criu: $*"; }
if [ -x "$CACHE/criu" ]; then install -m 0755 "$CACHE/criu" "$DEST"; say "$VERSION from $CACHE"; exit 0; fi
if [ "$(id -u)" != 0 ]; then say "not root: not built (snapshots stay off)"; exit 0; fi
build() {
  local work; work=$(mktemp -d)
  trap 'rm -rf "$work"' RETURN
  printf 'Types: deb-src\nURIs: http://deb.debian.org/debian\nSuites: trixie\nComponents: main\nSigned-By: %s\n' \
    /usr/share/keyrings/debian-archive-keyring.gpg > /etc/apt/sources.list.d/ember-trixie-src.sources
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libbsd-dev libcap-dev \
    libgnutls28-dev libnet1-dev libnl-3-dev libprotobuf-c-dev protobuf-c-compiler libprotobuf-dev \
    protobuf-compiler uuid-dev pkgconf xz-utils make gcc >/dev/null
  # Only the upstream tarball is needed (the Debian part of a source package leaves the pool as versions move on).
  (cd "$work" && apt-get source --download-only "criu=$VERSION-1" >/dev/null 2>&1 || true)
  rm -f /etc/apt/sources.list.d/ember-trixie-src.sources   # the host's apt sources as they were
  local tarball="$work/criu_$VERSION.orig.tar.xz"
  [ -f "$tarball" ] || { say "Debian's source for criu $VERSION could not be fetched"; return 1; }
  echo "$SHA256  $tarball" | sha256sum -c --quiet - || { say "criu_$VERSION.orig.tar.xz: sha256 mismatch"; return 1; }
  tar -xJf "$tarball" -C "$work"
  make -C "$work/criu-$VERSION" -j"$(nproc)" criu >"$work/build.log" 2>&1 || { tail -20 "$work/build.log"; return 1; }
  mkdir -p "$CACHE"
  install -m 0755 "$work/criu-$VERSION/criu/criu" "$CACHE/criu"
}
if build; then install -m 0755 "$CACHE/criu" "$DEST"; say "$VERSION built into $CACHE"; else
  say "not built (snapshots stay off)"; fi
