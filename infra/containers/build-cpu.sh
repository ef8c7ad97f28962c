#!/usr/bin/env bash
# Builds the CPU image (infra/containers/Containerfile.cpu) with buildah, no daemon: the context is
# this checkout's files (git ls-files), the venv and node_modules that infra/bootstrap.sh made, the
# tiny model and this machine's node binary. Without MOLT_BASE_IMAGE (a registry's
# debian:bookworm-slim), the Debian bookworm base is made from the Debian mirror with debootstrap.
# Writes localhost/molt-cpu:latest and, with --archive, .molt/image/molt-cpu.tar (oci-archive).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=$PWD/.molt/image
CTX=$OUT/context
say() { echo "[build-cpu $(date -u +%T)] $*"; }
for tool in buildah debootstrap; do
  command -v $tool >/dev/null || { say "installing $tool"; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $tool >/dev/null; }
done
[ -x .venv/bin/python ] && [ -d node_modules ] || { echo "run infra/bootstrap.sh first (no .venv or node_modules)" >&2; exit 2; }

BASE=${MOLT_BASE_IMAGE:-localhost/molt-debian:bookworm}
if [ -z "${MOLT_BASE_IMAGE:-}" ] && ! buildah inspect --type image "$BASE" >/dev/null 2>&1; then
  say "Debian bookworm base from the Debian mirror (debootstrap --variant=minbase)"
  rm -rf "$OUT/rootfs" && mkdir -p "$OUT"
  debootstrap --variant=minbase bookworm "$OUT/rootfs" "${MOLT_DEBIAN_MIRROR:-http://deb.debian.org/debian}" >/dev/null
  rm -rf "$OUT"/rootfs/var/cache/apt/archives/*.deb "$OUT"/rootfs/var/lib/apt/lists/*
  ctr=$(buildah from scratch)
  buildah copy --quiet "$ctr" "$OUT/rootfs" / >/dev/null
  buildah config --cmd /bin/bash "$ctr"
  buildah commit --quiet --rm "$ctr" "$BASE" >/dev/null
  rm -rf "$OUT/rootfs"
fi

say "context: the checkout, its venv and node_modules, the tiny model, node $(node --version)"
rm -rf "$CTX" && mkdir -p "$CTX/molt/.molt/models"
git ls-files -z | xargs -0 cp --parents -t "$CTX/molt" 2>/dev/null || true
cp -a "$(realpath node_modules)" "$CTX/molt/node_modules"
cp -a "$(realpath .venv)" "$CTX/molt/.venv"
cp -a "$(realpath .molt/models/tiny)" "$CTX/molt/.molt/models/tiny"
cp "$(command -v node)" "$CTX/node"
# The venv's interpreter becomes Debian's python3.11 (same minor version: the wheels are cp311), and
# its scripts' first lines point at /molt/.venv instead of this checkout.
V=$CTX/molt/.venv
for py in python python3 python3.11; do ln -sfn /usr/bin/python3.11 "$V/bin/$py"; done
sed -i 's|^home = .*|home = /usr/bin|' "$V/pyvenv.cfg"
grep -rlI '^#!.*/python' "$V/bin" | xargs sed -i '1s|^#!.*/python.*|#!/molt/.venv/bin/python|'
find "$CTX" -name __pycache__ -prune -exec rm -rf {} +

say "buildah bud"
# chroot isolation: crun refuses this machine's cgroups ("cgroups in hybrid mode not supported").
buildah bud --quiet --network host --isolation chroot --layers=false -f "$PWD/infra/containers/Containerfile.cpu" \
  --build-arg BASE="$BASE" -t localhost/molt-cpu:latest "$CTX"
rm -rf "$CTX"
if [ "${1:-}" = --archive ]; then
  buildah push --quiet localhost/molt-cpu:latest "oci-archive:$OUT/molt-cpu.tar"
  say "archive $OUT/molt-cpu.tar ($(du -h "$OUT/molt-cpu.tar" | cut -f1))"
fi
say "image localhost/molt-cpu:latest, $(buildah images --format '{{.Size}}' localhost/molt-cpu:latest)"
