#!/usr/bin/env bash
# Publishes what `make release` wrote to an OCI registry, signed (make publish):
#   <dest>/dynamig:<version>          the image, pushed as built (skopeo; its manifest digest unchanged)
#   <dest>/charts/dynamig:<version>   the chart as an OCI artefact (helm push)
# and, with a cosign key (COSIGN_KEY; COSIGN_PASSWORD unlocks it), a signature on the image's and the
# chart's digests and the SBOM attached to the image as a signed SPDX attestation. No transparency log is
# written (a registry mirrored inside a network cannot reach one): verify with the public key and
# --insecure-ignore-tlog=true, as docs/install.md shows. The same script mirrors a release into a team's own
# registry.
#   usage: hack/publish.sh DEST [RELEASE_DIR]    DEST: host[:port]/path, e.g. 127.0.0.1:5000/platform
#   prints "image <ref>@<digest>" and "chart oci://<ref> <version> <digest>" on stdout (logs go to stderr)
# PLAIN_HTTP=1 talks plain HTTP to the registry (one on the loopback address); DYNAMIG_HELM, DYNAMIG_COSIGN
# name the tools (default: built by hack/build-helm.sh and hack/build-oci-tool.sh).
set -euo pipefail

dest="${1:?usage: hack/publish.sh DEST [RELEASE_DIR]}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
release="${2:-$root/dist/release}"
log() { echo "[publish] $*" >&2; }
dest="${dest%/}"

chart_tgz=("$release"/dynamig-*.tgz)
[ -f "${chart_tgz[0]}" ] || { echo "no chart package in $release: run make release first" >&2; exit 1; }
version="$(basename "${chart_tgz[0]}" .tgz)"; version="${version#dynamig-}"
archive="$release/dynamig-image-$version.oci.tar"
sbom="$release/dynamig-$version.spdx.json"
for f in "$archive" "$archive.digest" "$sbom"; do
  [ -f "$f" ] || { echo "$f is missing: make release builds the image and its SBOM (RELEASE_IMAGE=1)" >&2; exit 1; }
done
(cd "$release" && sha256sum --check --strict --quiet SHA256SUMS) \
  || { echo "$release does not match its SHA256SUMS" >&2; exit 1; }
command -v skopeo >/dev/null || { echo "skopeo is required (apt-get install skopeo)" >&2; exit 1; }
helm="$(bash "$root/hack/build-helm.sh")"

tls=(); helm_tls=(); cosign_tls=()
if [ "${PLAIN_HTTP:-0}" = 1 ]; then
  tls=(--dest-tls-verify=false); helm_tls=(--plain-http); cosign_tls=(--allow-http-registry=true)
fi

digest="$(cat "$archive.digest")"
log "image $dest/dynamig:$version ($digest)"
skopeo copy --quiet --preserve-digests "${tls[@]}" "oci-archive:$archive" "docker://$dest/dynamig:$version" >&2
image="$dest/dynamig@$digest"

log "chart oci://$dest/charts/dynamig:$version"
pushed="$("$helm" push "${chart_tgz[0]}" "oci://$dest/charts" "${helm_tls[@]}" 2>&1)" \
  || { echo "$pushed" >&2; exit 1; }
chart_digest="$(sed -n 's/^Digest: //p' <<<"$pushed")"
[ -n "$chart_digest" ] || { echo "helm push printed no digest: $pushed" >&2; exit 1; }

if [ -n "${COSIGN_KEY:-}" ]; then
  cosign="$(bash "$root/hack/build-oci-tool.sh" cosign)"
  sign=(--yes --key "$COSIGN_KEY" --tlog-upload=false --use-signing-config=false "${cosign_tls[@]}")
  log "signing $image and $dest/charts/dynamig@$chart_digest (cosign)"
  "$cosign" sign "${sign[@]}" "$image" >&2
  "$cosign" sign "${sign[@]}" "$dest/charts/dynamig@$chart_digest" >&2
  log "attaching the SBOM to $image as a signed SPDX attestation"
  "$cosign" attest "${sign[@]}" --type spdxjson --predicate "$sbom" "$image" >&2
else
  log "COSIGN_KEY is not set: nothing signed"
fi
echo "image $image"
echo "chart oci://$dest/charts/dynamig $version $chart_digest"
