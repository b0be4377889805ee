#!/usr/bin/env bash
# Builds one of the tools the registry test publishes and verifies a release with, from its Go module at a
# pinned release (`go install module/cmd@version`: the module's own go.mod fixes every dependency), cached:
#   registry   CNCF distribution's registry: the local OCI registry the release is pushed to and pulled from
#   cosign     sigstore's cosign: signs the image and the chart, attests the SBOM, verifies both
#   syft       anchore's syft: the image's SPDX SBOM, from what its file system holds
#   usage: hack/build-oci-tool.sh TOOL    -> prints the path of the binary on stdout (logs go to stderr)
# DYNAMIG_<TOOL>=/path/to/binary (DYNAMIG_REGISTRY, DYNAMIG_COSIGN, DYNAMIG_SYFT) skips the build.
set -euo pipefail

tool="${1:-}"
case "$tool" in
  registry) module=github.com/distribution/distribution/v3; pkg=cmd/registry; version="${DYNAMIG_DISTRIBUTION_VERSION:-v3.1.2}" ;;
  cosign) module=github.com/sigstore/cosign/v3; pkg=cmd/cosign; version="${DYNAMIG_COSIGN_VERSION:-v3.1.3}" ;;
  syft) module=github.com/anchore/syft; pkg=cmd/syft; version="${DYNAMIG_SYFT_VERSION:-v1.57.2}" ;;
  *) echo "usage: hack/build-oci-tool.sh registry|cosign|syft" >&2; exit 2 ;;
esac
override="DYNAMIG_${tool^^}"
if [ -n "${!override:-}" ]; then
  [ -x "${!override}" ] || { echo "$override=${!override} is not executable" >&2; exit 1; }
  echo "${!override}"; exit 0
fi

log() { echo "[build-oci-tool] $*" >&2; }
# shellcheck source=hack/lib/go-tool.sh
source "$(dirname "$0")/lib/go-tool.sh"
go_tool_begin "$tool" "$tool-$version"
trap step_abort EXIT
step_begin "building $tool $version (once; cached in $OUT)"
# The version each tool reports is stamped as its own release builds stamp it.
case "$tool" in
  registry) ldflags="-X github.com/distribution/distribution/v3/version.version=$version" ;;
  cosign) ldflags="-X sigs.k8s.io/release-utils/version.gitVersion=$version" ;;
  syft) ldflags="-X main.version=${version#v}" ;;
esac
(cd "$work" && GOBIN="$OUT/bin.tmp" go install -trimpath -ldflags="-s -w $ldflags" "$module/$pkg@$version" >&2)
mv "$OUT/bin.tmp/$tool" "$BIN" && rmdir "$OUT/bin.tmp"
step_end
log "done: $BIN"
echo "$BIN"
