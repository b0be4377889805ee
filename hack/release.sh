#!/usr/bin/env bash
# Builds the release artefacts of the checked-out commit into dist/release/ (make release):
#   dynamig-<version>.tgz               the Helm chart (helm package; `helm push` it to an OCI registry)
#   dynamig.yaml                        one install manifest: the CRDs, then manifests/deploy/dynamig.yaml
#   image-context/ (and its .tar.gz)    the image build context; the Dockerfile's version and revision
#                                       defaults filled in, the base image pinned by digest, the lock files
#   dynamig-image-<version>.oci.tar    the image built from that context (hack/build-image.sh: buildah, on a
#     (and .digest)                    Python base made from Debian packages), its manifest digest beside it
#   dynamig-<version>.spdx.json         SPDX 2.3 SBOM of the image made by syft: the Python packages it
#                                       installs and the Debian packages of its root filesystem
#   SHA256SUMS
# Refuses a dirty tree (the artefacts would not match any commit) unless ALLOW_DIRTY=1, and then marks the
# revision "-dirty". RELEASE_DIR overrides the output folder; PYTHON the interpreter (default: .venv's).
# RELEASE_IMAGE=0 leaves the image and its SBOM out: building it needs root, the Debian mirror and PyPI.
# hack/publish.sh pushes these artefacts to an OCI registry and signs them.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${RELEASE_DIR:-$root/dist/release}"
python="${PYTHON:-$root/.venv/bin/python}"
chart="$root/manifests/helm/dynamig"
log() { echo "[release] $*" >&2; }

revision="$(git rev-parse HEAD)"
if [ -n "$(git status --porcelain --untracked-files=normal)" ]; then
  if [ "${ALLOW_DIRTY:-0}" != 1 ]; then
    git status --short >&2
    echo "the working tree has changes: commit them, or set ALLOW_DIRTY=1 for a build marked -dirty" >&2
    exit 1
  fi
  revision="$revision-dirty"
fi

version="$("$python" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' pyproject.toml)"
chart_version="$(sed -n 's/^version: *//p' "$chart/Chart.yaml")"
app_version="$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$chart/Chart.yaml")"
if [ "$chart_version" != "$version" ] || [ "$app_version" != "$version" ]; then
  echo "Chart.yaml version $chart_version / appVersion $app_version differ from pyproject's $version" >&2
  exit 1
fi

helm="$(bash hack/build-helm.sh)"
# The plain manifests and the chart's CRD copies must be what the chart renders (this also lints it).
DYNAMIG_HELM="$helm" bash hack/render-manifests.sh --check >/dev/null

rm -rf "$out"
mkdir -p "$out"
log "dynamig $version at $revision -> $out"

"$helm" package "$chart" --destination "$out" >/dev/null

{
  echo "# dynamig $version ($revision): CRDs, namespace dynamig-system, RBAC, node admission policy,"
  echo "# operator, agent, DeviceClass. Rendered from the Helm chart by hack/render-manifests.sh."
  echo "#   kubectl apply --server-side -f dynamig.yaml"
  cat manifests/deploy/crds/crds.yaml
  echo "---"
  cat manifests/deploy/dynamig.yaml
} > "$out/dynamig.yaml"

# The build context: what .dockerignore admits (git's view of the tree, so nothing ignored or generated).
context="$out/image-context"
mkdir -p "$context"
git ls-files -z --cached --others --exclude-standard -- Dockerfile .dockerignore LICENSE pyproject.toml \
    README.md requirements operator \
  | while IFS= read -r -d '' path; do
      [ -f "$path" ] || continue  # deleted in the working tree
      mkdir -p "$context/$(dirname "$path")"
      cp -p "$path" "$context/$path"
    done
sed -i -e "s/^ARG DYNAMIG_VERSION=.*/ARG DYNAMIG_VERSION=$version/" \
       -e "s/^ARG DYNAMIG_REVISION=.*/ARG DYNAMIG_REVISION=$revision/" "$context/Dockerfile"
grep -qx "ARG DYNAMIG_VERSION=$version" "$context/Dockerfile" \
  || { echo "the Dockerfile has no ARG DYNAMIG_VERSION line to fill in" >&2; exit 1; }
grep -qx "ARG DYNAMIG_REVISION=$revision" "$context/Dockerfile" \
  || { echo "the Dockerfile has no ARG DYNAMIG_REVISION line to fill in" >&2; exit 1; }
# Reproducible tarball: sorted names, the commit's time, no owners.
commit_time="$(git log -1 --format=%ct)"
tar --sort=name --mtime="@$commit_time" --owner=0 --group=0 --numeric-owner -C "$out" -cf - image-context \
  | gzip -n > "$out/dynamig-$version-image-context.tar.gz"

image=()
if [ "${RELEASE_IMAGE:-1}" != 0 ]; then
  log "building the image (hack/build-image.sh)"
  image=("$(DYNAMIG_REVISION="$revision" bash hack/build-image.sh --out "$out")")
fi

if [ ${#image[@]} -gt 0 ]; then
  # The image's SBOM as scanners expect it: syft's catalogue of what the image's file system holds (the
  # Python distributions in its site-packages, the Debian packages in its dpkg database).
  syft="$(bash hack/build-oci-tool.sh syft)"
  log "SBOM of the image (syft)"
  SYFT_CHECK_FOR_APP_UPDATE=false "$syft" scan --quiet "oci-archive:${image[0]}" \
    --source-name dynamig --source-version "$version" -o "spdx-json=$out/dynamig-$version.spdx.json"
else
  log "no image (RELEASE_IMAGE=0): no SBOM"
fi

sums="$(mktemp)"
(cd "$out" && find . -maxdepth 1 -type f -printf '%f\n' | sort | xargs sha256sum) > "$sums"
mv "$sums" "$out/SHA256SUMS" && chmod 644 "$out/SHA256SUMS"
log "done: $(find "$out" -mindepth 1 -maxdepth 1 -printf '%f\n' | sort | tr '\n' ' ')"
