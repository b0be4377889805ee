#!/usr/bin/env bash
# Builds cdi-validate: a small Go program that checks CDI spec files with the CDI project's own Go code
# (tags.cncf.io/container-device-interface, pkg/cdi: the parser and validation container runtimes use), plus
# an optional JSON schema check with the JSON schema library that CDI's schema package uses.
#   usage: hack/build-cdi-validate.sh        -> prints the path of the binary on stdout (logs go to stderr)
#   then:  cdi-validate [-schema schema.json] SPEC...   one JSON line per spec; exit 1 if any is invalid
# Output is cached per version and recipe: a second run builds nothing. Set DYNAMIG_CDI_VALIDATE to an
# existing binary to skip the build.
set -euo pipefail

if [ -n "${DYNAMIG_CDI_VALIDATE:-}" ]; then
  [ -x "$DYNAMIG_CDI_VALIDATE" ] || { echo "DYNAMIG_CDI_VALIDATE=$DYNAMIG_CDI_VALIDATE is not executable" >&2; exit 1; }
  echo "$DYNAMIG_CDI_VALIDATE"; exit 0
fi

CDI_VERSION="${DYNAMIG_CDI_VERSION:-v1.1.2}"
JSONSCHEMA_VERSION="${DYNAMIG_CDI_JSONSCHEMA_VERSION:-v6.0.3}"
# Bump when main.go below changes: a binary built from an older recipe is rebuilt.
RECIPE=1
log() { echo "[build-cdi-validate] $*" >&2; }
# shellcheck source=hack/lib/go-tool.sh
source "$(dirname "$0")/lib/go-tool.sh"
go_tool_begin cdi-validate "cdi-validate-${CDI_VERSION}-r${RECIPE}"
trap step_abort EXIT
step_begin "building cdi-validate (tags.cncf.io/container-device-interface $CDI_VERSION; once, cached in $OUT)"

cat > "$work/go.mod" <<GOMOD
module dynamig.io/tools/cdi-validate

go 1.23

require (
	github.com/santhosh-tekuri/jsonschema/v6 $JSONSCHEMA_VERSION
	tags.cncf.io/container-device-interface $CDI_VERSION
)
GOMOD
cat > "$work/main.go" <<'GO'
// cdi-validate reads CDI spec files the way a container runtime's CDI cache does (pkg/cdi.ReadSpec:
// strict YAML/JSON decoding, version, vendor/class, device name, annotation and container-edit checks) and,
// with -schema, first validates each spec against a CDI JSON schema, as the upstream `cdi` CLI does with
// its --schema flag. Prints one JSON line per file; exits 1 if any file is invalid.
package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"

	"github.com/santhosh-tekuri/jsonschema/v6"
	"tags.cncf.io/container-device-interface/pkg/cdi"
	"tags.cncf.io/container-device-interface/pkg/parser"
	specs "tags.cncf.io/container-device-interface/specs-go"
)

type schemaValidator struct{ schema *jsonschema.Schema }

func (v schemaValidator) Validate(spec *specs.Spec) error {
	data, err := json.Marshal(spec)
	if err != nil {
		return err
	}
	doc, err := jsonschema.UnmarshalJSON(bytes.NewReader(data))
	if err != nil {
		return err
	}
	return v.schema.Validate(doc)
}

type result struct {
	Path    string   `json:"path"`
	Valid   bool     `json:"valid"`
	Error   string   `json:"error,omitempty"`
	Kind    string   `json:"kind,omitempty"`
	Version string   `json:"cdiVersion,omitempty"`
	Devices []string `json:"devices,omitempty"`
}

func main() {
	schemaFile := flag.String("schema", "", "JSON schema file to validate each spec against first")
	flag.Parse()
	if flag.NArg() == 0 {
		fmt.Fprintln(os.Stderr, "usage: cdi-validate [-schema schema.json] SPEC...")
		os.Exit(2)
	}
	if *schemaFile != "" {
		abs, err := filepath.Abs(*schemaFile)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		sch, err := jsonschema.NewCompiler().Compile(abs)
		if err != nil {
			fmt.Fprintf(os.Stderr, "cannot load JSON schema %s: %v\n", abs, err)
			os.Exit(2)
		}
		cdi.SetSpecValidator(schemaValidator{sch})
	}
	exit := 0
	out := json.NewEncoder(os.Stdout)
	for _, path := range flag.Args() {
		r := result{Path: path}
		spec, err := cdi.ReadSpec(path, 0)
		if err == nil {
			err = specs.ValidateVersion(spec.Spec)
		}
		if err != nil {
			r.Error = err.Error()
			exit = 1
		} else {
			r.Valid = true
			r.Kind = spec.Kind
			r.Version = spec.Version
			for _, d := range spec.Devices {
				r.Devices = append(r.Devices, parser.QualifiedName(spec.GetVendor(), spec.GetClass(), d.Name))
			}
		}
		_ = out.Encode(r)
	}
	os.Exit(exit)
}
GO

(cd "$work" && go mod tidy >&2 && go build -trimpath -ldflags='-s -w' -o "$BIN.tmp" . >&2)
mv "$BIN.tmp" "$BIN"
step_end
log "done: $BIN"
echo "$BIN"
