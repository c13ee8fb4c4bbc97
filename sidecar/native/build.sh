#!/usr/bin/env bash
# Builds the sidecar's compiled kernels (kernels.c) next to this script as a CPython
# extension module for the Python that runs it (PYTHON, default python3): its headers and
# its extension suffix, e.g. _kernels.cpython-311-x86_64-linux-gnu.so. Used by `make native`
# (with the venv's Python) and deploy/docker/Dockerfile.sidecar's build stage. Needs a C
# compiler and Python's headers (python:3.11-slim has the headers; Debian: python3-dev). The
# sidecar works without it (numpy paths, the same verdicts): kvguard.sidecar.native says which.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${PYTHON:-python3}"
cc="${CC:-cc}"
include="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
suffix="$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
if [ ! -f "$include/Python.h" ]; then
  echo "sidecar kernels: no Python.h in $include (install the Python headers, e.g. python3-dev)" >&2
  exit 1
fi
out="$here/_kernels$suffix"
"$cc" -O2 -fPIC -shared -fno-strict-aliasing -Wall -Wextra -Werror -I"$include" -o "$out.tmp" "$here/kernels.c"
mv "$out.tmp" "$out"
echo "sidecar kernels built: $(basename "$out")"
