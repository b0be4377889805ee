# Sourced by the build scripts: writes a Go module in directory $1 that requires k8s.io/kubernetes $2 with a
# replace directive per staging module (k8s.io/kubernetes requires them at v0.0.0), so its commands build
# with plain `go build`. Prints the -ldflags that stamp the release version the way the Kubernetes release
# build does (otherwise /version and `kubectl version` say v0.0.0-master).
# The Kubernetes version the control plane, the real node and the tests target unless DYNAMIG_K8S_VERSION says
# otherwise; the others the tests run against are dynamig.devcluster.versions.MATRIX (kept equal by a test).
K8S_PRIMARY_VERSION=v1.37.2

k8s_wrapper_module() {
  local dir="$1" version="$2" gomod staging_version major minor ldflags pkg
  mkdir -p "$dir"
  gomod=$(cd "$dir" && go mod download -json "k8s.io/kubernetes@$version" | sed -n 's/^\s*"GoMod": "\(.*\)",\?$/\1/p')
  staging_version="v0${version#v1}"
  {
    echo "module dynamig.io/k8s-tools"
    echo
    echo "go 1.26.0"
    echo
    echo "require k8s.io/kubernetes $version"
    echo
    grep -E '^\s+k8s\.io/[a-z0-9-]+ v0\.0\.0$' "$gomod" | awk -v v="$staging_version" '{print "replace " $1 " => " $1 " " v}'
  } > "$dir/go.mod"
  major="${version#v}"; major="${major%%.*}"
  minor="${version#v*.}"; minor="${minor%%.*}"
  ldflags="-s -w"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$version -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
  done
  echo "$ldflags"
}
