#!/usr/bin/env bash
# Renders the plain manifests for `kubectl apply -k` from the Helm chart, so both install paths come from
# one source. Also copies the repository's crds/ and dashboards/ (their one source) into the chart.
#   usage: hack/render-manifests.sh           -> syncs the chart's CRDs and writes manifests/deploy/
#          hack/render-manifests.sh --check   -> exits 1 (and shows a diff) when either is out of date
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
chart="$root/manifests/helm/dynamig"
deploy="$root/manifests/deploy"
release=dynamig
namespace=dynamig-system
check=false
[ "${1:-}" = "--check" ] && check=true

helm="$("$root/hack/build-helm.sh")"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

# 1. The chart's copies of the CRDs and the dashboard (helm cannot read files outside the chart directory).
mkdir -p "$out/chart-crds" "$out/chart-dashboards"
cp "$root"/crds/*.yaml "$out/chart-crds/"
cp "$root"/dashboards/*.json "$out/chart-dashboards/"

# 2. Plain manifests: CRDs in their own kustomization (apply them first, then everything else).
mkdir -p "$out/deploy/crds"
render() {
  # Render with a chart whose files/crds is the fresh copy, so --check also sees CRD edits.
  local tmpchart="$out/chart"
  rm -rf "$tmpchart"; cp -r "$chart" "$tmpchart"
  rm -rf "$tmpchart/files/crds"; mkdir -p "$tmpchart/files/crds"; cp "$out"/chart-crds/*.yaml "$tmpchart/files/crds/"
  rm -rf "$tmpchart/files/dashboards"; cp -r "$out/chart-dashboards" "$tmpchart/files/dashboards"
  "$helm" lint --quiet --strict "$tmpchart" --namespace "$namespace" >&2
  "$helm" template "$release" "$tmpchart" --namespace "$namespace" \
    --set namespace.create=true "$@"
}
header="# Rendered from manifests/helm/dynamig by hack/render-manifests.sh; do not edit by hand."
{
  echo "$header"
  render --show-only templates/crds.yaml
  # The chart's own crds/ directory (Kopf's peering CRD), as helm installs it before the templates.
  for f in "$chart"/crds/*.yaml; do echo "---"; echo "# Source: dynamig/crds/$(basename "$f")"; cat "$f"; done
} > "$out/deploy/crds/crds.yaml"
{
  echo "$header"
  # No Helm hooks: kubectl would run the pre-delete uninstall Job at once (docs/operations.md: run
  # `dynamig uninstall` before `kubectl delete -k manifests/deploy`).
  render --set crds.install=false --no-hooks
} > "$out/deploy/dynamig.yaml"
cat > "$out/deploy/crds/kustomization.yaml" <<'YAML'
# CRDs only: `kubectl apply --server-side -k manifests/deploy/crds` before the rest, so the objects of the
# new kinds (the Kopf peering object) find their CRDs established.
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
- crds.yaml
YAML
cat > "$out/deploy/kustomization.yaml" <<'YAML'
# dynamig: CRDs, namespace dynamig-system, RBAC, node admission policy, operator, agent, DeviceClass.
#   kubectl apply --server-side -k manifests/deploy/crds
#   kubectl wait --for=condition=Established crd -l app.kubernetes.io/part-of=dynamig
#   kubectl apply --server-side -k manifests/deploy
# To change the image, add an `images:` entry in an overlay that uses this directory as a resource.
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
- crds
- dynamig.yaml
YAML

if $check; then
  rc=0
  diff -ru "$chart/files/crds" "$out/chart-crds" || rc=1
  diff -ru "$chart/files/dashboards" "$out/chart-dashboards" || rc=1
  diff -ru "$deploy" "$out/deploy" || rc=1
  if [ $rc -ne 0 ]; then echo "manifests are out of date: run hack/render-manifests.sh" >&2; fi
  exit $rc
fi
rm -rf "$chart/files/crds"; mkdir -p "$chart/files/crds"; cp "$out"/chart-crds/*.yaml "$chart/files/crds/"
rm -rf "$chart/files/dashboards"; cp -r "$out/chart-dashboards" "$chart/files/dashboards"
rm -rf "$deploy"; cp -r "$out/deploy" "$deploy"
echo "rendered $deploy" >&2
