#!/usr/bin/env bash
# Builds the compiled alg-3 digest routine next to this script (engine_hooks/native):
#   libkvguard_digest.so       baseline build for this machine's architecture
#   libkvguard_digest_avx2.so  x86-64 only: the same with AVX2 (loaded where the CPU has it)
# Needs a C compiler and xxhash.h (Debian/Ubuntu: gcc libxxhash-dev). Used by
# `make native` and deploy/docker/Dockerfile.engine. The hooks work without it
# (numpy path, same digests): engine_hooks/native/__init__.py.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cc="${CC:-cc}"
# -O2: in place, -O3 measured no faster; -fno-strict-aliasing: the state is read
# through xxh3's own casts
flags=(-O2 -fPIC -shared -fno-strict-aliasing -Wall -Wextra -Werror)
src="$here/head_streams.c"
"$cc" "${flags[@]}" -o "$here/libkvguard_digest.so.tmp" "$src"
mv "$here/libkvguard_digest.so.tmp" "$here/libkvguard_digest.so"
if [ "$(uname -m)" = x86_64 ]; then
  "$cc" "${flags[@]}" -mavx2 -o "$here/libkvguard_digest_avx2.so.tmp" "$src"
  mv "$here/libkvguard_digest_avx2.so.tmp" "$here/libkvguard_digest_avx2.so"
fi
echo "native digest built: $(cd "$here" && ls libkvguard_digest*.so | tr '\n' ' ')"
