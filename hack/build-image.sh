#!/usr/bin/env bash
# Builds the dynamig image from the Dockerfile without a Docker engine (make image), as an OCI archive:
#   1. a Python base from Debian packages: mmdebstrap's bookworm minbase with python3 (3.11, as the pinned
#      upstream base), python3-venv, python-is-python3 and ca-certificates, made an OCI image by umoci;
#      cached in <cache>/image-base/<suite>-<package set hash>-<Debian archive date>/;
#   2. `buildah bud` of the Dockerfile (chroot isolation, overlay storage of its own under <cache>/image/),
#      that base passed through the Dockerfile's PYTHON_BASE and PYTHON_DIGEST args; the wheels come from
#      the hash-locked requirements/*.lock via PyPI, as in any build of the Dockerfile;
#   3. the image as an OCI archive in <cache>/image/archive/<inputs hash>/: the same inputs (build context,
#      base digest, version, revision, builder version) build once, and a second run only prints the path.
#   usage: hack/build-image.sh [--out DIR]    -> prints the archive's path on stdout (logs go to stderr)
#     --out DIR   also copies it to DIR/dynamig-image-<version>.oci.tar, with its manifest digest in .digest
# The archive holds one manifest, named dynamig/dynamig:<version> (org.opencontainers.image.ref.name).
# Needs root (mmdebstrap's root mode, buildah's chroot isolation), the Debian mirror and PyPI; installs
# buildah, umoci, skopeo and mmdebstrap with apt-get when missing. Settings:
#   DYNAMIG_DEBIAN_MIRROR, DYNAMIG_DEBIAN_SECURITY_MIRROR   the mirrors (default deb.debian.org's)
#   DYNAMIG_DEBIAN_SNAPSHOT=20260901T000000Z   build the base from snapshot.debian.org at that time instead
#   DYNAMIG_IMAGE_BASE_REFRESH=1   build a new base when the mirror moved on (default: the newest cached base
#                                  of the same package set, so a security upload does not rebuild everything)
#   DYNAMIG_IMAGE_CA_BUNDLE   CA bundle the build's RUN steps trust for PyPI (default: PIP_CERT, else the
#                             host's /etc/ssl/certs/ca-certificates.crt; empty: the image's own)
#   DYNAMIG_REVISION          the revision label (default: the last commit that changed the build context,
#                             "-dirty" when the working tree changes it)
#   DYNAMIG_IMAGE_STORE_MAX_MB   past this size (default 8192) buildah's store and layer cache start over
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=hack/lib/progress.sh
source "$root/hack/lib/progress.sh"
log() { echo "[build-image] $*" >&2; }

out_dir=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out_dir="${2:?--out needs a directory}"; shift 2 ;;
    *) echo "usage: hack/build-image.sh [--out DIR]" >&2; exit 2 ;;
  esac
done

CACHE_ROOT="${DYNAMIG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dynamig}"
BASE_CACHE="$CACHE_ROOT/image-base"
IMAGE_CACHE="$CACHE_ROOT/image"
# Bump when the base or the image is built differently: cached ones of an older recipe are not reused.
BASE_RECIPE=1
IMAGE_RECIPE=2
SUITE=bookworm
PACKAGES=(ca-certificates python-is-python3 python3 python3-venv)
# What slim Debian images leave out; the copyright files stay.
DPKG_OPTS=(
  'path-exclude=/usr/share/doc/*' 'path-include=/usr/share/doc/*/copyright'
  'path-exclude=/usr/share/man/*' 'path-exclude=/usr/share/info/*' 'path-exclude=/usr/share/locale/*'
  'path-exclude=/usr/share/lintian/*'
)
BASE_NAME=localhost/dynamig-python-base
# The files the Dockerfile's COPY lines can see (.dockerignore narrows them further), as hack/release.sh.
CONTEXT_PATHS=(Dockerfile .dockerignore LICENSE pyproject.toml README.md requirements operator)
snapshot="${DYNAMIG_DEBIAN_SNAPSHOT:-}"
if [ -n "$snapshot" ]; then
  mirror="http://snapshot.debian.org/archive/debian/$snapshot"
  security="http://snapshot.debian.org/archive/debian-security/$snapshot"
else
  mirror="${DYNAMIG_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
  security="${DYNAMIG_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
fi
SOURCES=("deb $mirror $SUITE main" "deb $mirror $SUITE-updates main" "deb $security $SUITE-security main")

# --- tools -------------------------------------------------------------------------------------------------
[ "$(id -u)" -eq 0 ] || { echo "build-image: needs root (mmdebstrap, chroot isolation)" >&2; exit 1; }
missing=()
for tool in buildah:buildah umoci:umoci skopeo:skopeo mmdebstrap:mmdebstrap curl:curl; do
  command -v "${tool%%:*}" >/dev/null || missing+=("${tool#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  command -v apt-get >/dev/null \
    || { echo "build-image: needs ${missing[*]} (and apt-get to install them)" >&2; exit 1; }
  trap step_abort EXIT
  step_begin "installing ${missing[*]} (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y "${missing[@]}" >&2 || { apt-get update >&2 && apt-get install -y "${missing[@]}" >&2; }
  step_end
fi
store=(buildah --root "$IMAGE_CACHE/store/root" --runroot "$IMAGE_CACHE/store/run" --storage-driver overlay)

# --- the base: which one ---------------------------------------------------------------------------------
pkg_hash=$(printf '%s\n' "$BASE_RECIPE" "$SUITE" minbase "${PACKAGES[@]}" "${DPKG_OPTS[@]}" "${SOURCES[@]}" \
  | sha256sum | cut -c1-10)
base_prefix="$SUITE-$pkg_hash"
# The archive's state as snapshot.debian.org names it: the newest Date of the suites' InRelease files (any
# upload to any of them moves it on).
archive_date() {
  local epoch=0 url d e
  for url in "$mirror/dists/$SUITE" "$mirror/dists/$SUITE-updates" "$security/dists/$SUITE-security"; do
    d=$(curl -fsSL --max-time 30 "$url/InRelease" | sed -n 's/^Date: //p' | head -n1)
    [ -n "$d" ] || { echo "build-image: no Date in $url/InRelease" >&2; return 1; }
    e=$(date -u -d "$d" +%s)
    [ "$e" -le "$epoch" ] || epoch=$e
  done
  date -u -d "@$epoch" +%Y%m%dT%H%M%SZ
}
newest_base() {  # the newest complete base of this package set, or nothing
  local dir
  for dir in "$BASE_CACHE/$base_prefix"-*/; do
    if [ -f "$dir/digest" ]; then basename "$dir"; fi
  done | sort | tail -n1
}
base_key=""
if [ -n "$snapshot" ]; then
  base_key="$base_prefix-$snapshot"
elif [ "${DYNAMIG_IMAGE_BASE_REFRESH:-0}" != 1 ]; then
  base_key=$(newest_base)
fi
if [ -z "$base_key" ]; then
  date_key=$(archive_date) || {
    base_key=$(newest_base)
    [ -n "$base_key" ] || { echo "build-image: cannot read the Debian mirror's state ($mirror)" >&2; exit 1; }
    log "the mirror cannot be read: keeping the cached base $base_key"
  }
  [ -n "$base_key" ] || base_key="$base_prefix-$date_key"
fi
base_dir="$BASE_CACHE/$base_key"
base_date="${base_key##*-}"

# --- the image's inputs ----------------------------------------------------------------------------------
cd "$root"
version="$(python3 -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' \
  pyproject.toml)"
revision="${DYNAMIG_REVISION:-}"
if [ -z "$revision" ]; then
  revision="$(git log -1 --format=%H -- "${CONTEXT_PATHS[@]}")"
  if [ -n "$(git status --porcelain --untracked-files=normal -- "${CONTEXT_PATHS[@]}")" ]; then
    revision="$revision-dirty"
  fi
fi
mkdir -p "$IMAGE_CACHE" "$BASE_CACHE"
work=$(mktemp -d "$IMAGE_CACHE/work.XXXXXX")
trap 'step_abort; rm -rf "$work"' EXIT
context="$work/context"
git ls-files -z --cached --others --exclude-standard -- "${CONTEXT_PATHS[@]}" \
  | while IFS= read -r -d '' path; do
      [ -f "$path" ] || continue  # deleted in the working tree
      mkdir -p "$context/$(dirname "$path")"
      cp -p "$path" "$context/$path"
    done

# Only a cached base has a digest yet: with a base still to build, the image is to build as well.
inputs_hash() {
  {
    printf '%s\n' "image recipe $IMAGE_RECIPE" "base $BASE_NAME:$base_key@$(cat "$base_dir/digest")" \
      "version $version" "revision $revision"
    buildah --version
    (cd "$context" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum)
  } | sha256sum | cut -c1-32
}
finish() {  # archive directory -> the path printed, copied to --out first when asked
  local dir="$1" dest
  log "dynamig $version ($revision): $(cat "$dir/digest"), $(du -h "$dir/dynamig.oci.tar" | cut -f1)"
  if [ -z "$out_dir" ]; then echo "$dir/dynamig.oci.tar"; return; fi
  mkdir -p "$out_dir"
  dest="$out_dir/dynamig-image-$version.oci.tar"
  if ! cmp -s "$dir/digest" "$dest.digest" || ! [ -f "$dest" ]; then
    cp "$dir/dynamig.oci.tar" "$dest.tmp" && mv -f "$dest.tmp" "$dest"
    cp "$dir/digest" "$dest.digest"
  fi
  log "wrote $dest and $dest.digest"
  echo "$(cd "$(dirname "$dest")" && pwd)/$(basename "$dest")"
}
if [ -f "$base_dir/digest" ]; then
  hash=$(inputs_hash)
  if [ -f "$IMAGE_CACHE/archive/$hash/digest" ]; then finish "$IMAGE_CACHE/archive/$hash"; exit 0; fi
fi

exec 9>"$IMAGE_CACHE/.lock"
wait_for_lock 9 "the image build in $IMAGE_CACHE"
step_begin "building the dynamig $version image from the Dockerfile (buildah, Debian $SUITE base $base_date)"

# --- the base: building it -------------------------------------------------------------------------------
if ! [ -f "$base_dir/digest" ]; then
  step_begin "building the Python base: $SUITE minbase + ${PACKAGES[*]} (once; cached in $base_dir)"
  epoch=$(date -u -d "${base_date:0:8} ${base_date:9:2}:${base_date:11:2}:${base_date:13:2}" +%s)
  created=$(date -u -d "@$epoch" +%Y-%m-%dT%H:%M:%SZ)
  stage="$work/base"; mkdir -p "$stage"
  apt_opts=()
  # snapshot.debian.org serves Release files whose Valid-Until has passed.
  [ -z "$snapshot" ] || apt_opts=(--aptopt='Acquire::Check-Valid-Until "false"')
  # SOURCE_DATE_EPOCH: file times, the tarball and the config take the archive's date, not the build's.
  SOURCE_DATE_EPOCH=$epoch mmdebstrap --quiet --variant=minbase --include="$(IFS=,; echo "${PACKAGES[*]}")" \
    "${DPKG_OPTS[@]/#/--dpkgopt=}" "${apt_opts[@]}" "$SUITE" "$stage/rootfs.tar" "${SOURCES[@]}" >&2
  layout="$stage/oci"
  umoci init --layout "$layout"
  umoci new --image "$layout:base"
  umoci raw add-layer --image "$layout:base" --history.created "$created" \
    --history.created_by "mmdebstrap --variant=minbase --include=$(IFS=,; echo "${PACKAGES[*]}") $SUITE" \
    "$stage/rootfs.tar"
  umoci config --image "$layout:base" --created "$created" --history.created "$created" \
    --config.env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --config.env LANG=C.UTF-8 \
    --config.cmd python3
  umoci gc --layout "$layout"
  python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["manifests"][0]["digest"])' \
    "$layout/index.json" > "$stage/digest"
  rm -rf "$base_dir.tmp" && mkdir -p "$base_dir.tmp"
  mv "$layout" "$stage/digest" "$base_dir.tmp/" && mv "$base_dir.tmp" "$base_dir"
  # Keep this base and the one before it.
  for old in $(find "$BASE_CACHE" -mindepth 1 -maxdepth 1 -name "$base_prefix-*" -printf '%f\n' \
                 | sort | head -n -2); do
    rm -rf "${BASE_CACHE:?}/$old"
  done
  step_end
fi
base_digest=$(cat "$base_dir/digest")
hash=$(inputs_hash)
archive_dir="$IMAGE_CACHE/archive/$hash"
if [ -f "$archive_dir/digest" ]; then step_end; finish "$archive_dir"; exit 0; fi  # built while we waited

# --- the image -------------------------------------------------------------------------------------------
# The store keeps buildah's layer cache (--layers: a change under operator/ reruns only the wheel step);
# past DYNAMIG_IMAGE_STORE_MAX_MB it starts over.
store_max_mb="${DYNAMIG_IMAGE_STORE_MAX_MB:-8192}"
if [ -d "$IMAGE_CACHE/store" ] && [ "$(du -sm "$IMAGE_CACHE/store" | cut -f1)" -gt "$store_max_mb" ]; then
  log "the build store is over $store_max_mb MB: starting it over"
  "${store[@]}" rm --all >/dev/null 2>&1 || true
  rm -rf "$IMAGE_CACHE/store"
fi
stored=$("${store[@]}" images --digests --format '{{.Digest}}' "$BASE_NAME:$base_key" 2>/dev/null || true)
if [ "$stored" != "$base_digest" ]; then
  step "loading the base into the build store" skopeo copy --quiet "oci:$base_dir/oci:base" \
    "containers-storage:[overlay@$IMAGE_CACHE/store/root+$IMAGE_CACHE/store/run]$BASE_NAME:$base_key" >&2
fi

build_args=(
  --build-arg "PYTHON_BASE=$BASE_NAME:$base_key" --build-arg "PYTHON_DIGEST=$base_digest"
  --build-arg "DYNAMIG_VERSION=$version" --build-arg "DYNAMIG_REVISION=$revision"
)
# A pip config bind-mounted for the RUN steps only (out of the image; its empty mount point stays in the
# build stage): no progress bars in the log, and where PyPI is reached through a TLS-inspecting proxy the
# host trusts, the host's CA bundle, mounted over the image's (pip reads no system store by itself).
printf '[global]\nprogress-bar = off\n' > "$work/pip.conf"
mounts=(-v "$work/pip.conf:/etc/pip.conf:ro")
ca="${DYNAMIG_IMAGE_CA_BUNDLE-${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}}"
if [ -n "$ca" ] && [ -f "$ca" ]; then
  printf 'cert = /etc/ssl/certs/ca-certificates.crt\n' >> "$work/pip.conf"
  mounts+=(-v "$(readlink -f "$ca"):/etc/ssl/certs/ca-certificates.crt:ro")
fi
tag="localhost/dynamig:$version-${hash:0:12}"
# buildah 1.28's layer cache matches a LABEL step by its text, not by the build args it expands: a cached
# runtime stage would keep an older build's revision. Every image of that stage from the LABEL step on
# carries the labels, so dropping those images rebuilds the stage (a copy, seconds); the build stage's
# layers, the slow part, stay cached.
old_ids=$("${store[@]}" images --all --quiet --no-trunc --filter label=org.opencontainers.image.title=dynamig)
# shellcheck disable=SC2086 # one image id a word
[ -z "$old_ids" ] || "${store[@]}" rmi --force $old_ids >/dev/null
step_begin "buildah bud --isolation chroot --layers (the Dockerfile's two stages; pip installs the lock)"
# chroot isolation: the RUN steps need no OCI runtime, cgroup or network namespace (crun, buildah's default
# runtime, refuses a cgroup v1 hybrid host). No identity label: the labels are the Dockerfile's.
"${store[@]}" bud --isolation chroot --pull=never --layers --format oci --identity-label=false \
  "${build_args[@]}" "${mounts[@]}" \
  -f "$context/Dockerfile" -t "$tag" "$context" >&2
step_end

step_begin "writing the OCI archive"
mkdir -p "$work/archive"
"${store[@]}" push --quiet "$tag" "oci-archive:$work/archive/dynamig.oci.tar:dynamig/dynamig:$version" >&2
tar -xOf "$work/archive/dynamig.oci.tar" index.json \
  | python3 -c 'import json, sys; print(json.load(sys.stdin)["manifests"][0]["digest"])' \
  > "$work/archive/digest"
mkdir -p "$IMAGE_CACHE/archive"
rm -rf "$archive_dir" && mv "$work/archive" "$archive_dir"
# Keep the five newest archives (a test run builds three: this tree, a release snapshot, an upgrade build).
for old in $(find "$IMAGE_CACHE/archive" -mindepth 1 -maxdepth 1 -type d -printf '%T@ %f\n' | sort -rn \
               | tail -n +6 | cut -d" " -f2); do
  rm -rf "${IMAGE_CACHE:?}/archive/$old"
done
step_end
step_end
finish "$archive_dir"
