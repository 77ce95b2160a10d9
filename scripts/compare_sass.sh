#!/usr/bin/env bash
# Compares the device code (SASS) of the CUDA kernels in two source trees, kernel by kernel, to
# show that a change which only moved or renamed code left the generated code as it was.
#
#   scripts/compare_sass.sh [OLD [NEW]]
#
# OLD and NEW are each a folder holding xla_ext/ (a checkout) or a git revision of this
# repository; OLD defaults to HEAD, NEW to this working tree. Every xla_ext/cuda/*.cu of each
# is compiled to a cubin per architecture with the flags xla_ext/CMakeLists.txt gives nvcc in a
# Release build, disassembled with cuobjdump, and the kernels are matched by name across all
# translation units (so kernels may move between files). Prints "identical" per architecture,
# or the kernels that differ or exist on one side only; exits 1 if any differ.
#
# Environment:
#   ARCHS      architectures to compare (default "80 90a", as the build)
#   JOBS       parallel nvcc runs (default: the number of cores)
#   XLA_DIR    XLA FFI headers (default: jax.ffi.include_dir() of .venv/bin/python, or python3)
#   NVCC       nvcc (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc)
#   CUOBJDUMP  cuobjdump (default: on PATH, else in the CUDA toolkit, else in the
#              nvidia-cuda-cuobjdump wheel of the Python found above); it needs nvdisasm on
#              PATH, beside it or in NVDISASM_PATH (the nvidia-cuda-nvdisasm wheel has one)
#   SASS_CACHE a folder to keep the disassembly of git revisions in, reused on the next run
#   KEEP       a folder to leave this run's per-kernel listings in (default: a temporary one)
set -euo pipefail
export LC_ALL=C  # one collation for sort, comm and diff
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"

old=${1:-HEAD}
new=${2:-$repo}
archs=${ARCHS:-80 90a}
jobs=${JOBS:-$(nproc)}

py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
if [ -z "${XLA_DIR:-}" ]; then
  XLA_DIR=$("$py" -c 'import jax.ffi; print(jax.ffi.include_dir())')
fi
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
cuobjdump=${CUOBJDUMP:-$(command -v cuobjdump || true)}
if [ -z "$cuobjdump" ]; then
  wheel=$("$py" -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "bin"))' \
    2>/dev/null || true)
  for c in "$(dirname "$(readlink -f "$nvcc")")/cuobjdump" /usr/local/cuda/bin/cuobjdump \
      "$wheel/cuobjdump"; do
    if [ -x "$c" ]; then cuobjdump=$c; break; fi
  done
fi
[ -n "$cuobjdump" ] || { echo "no cuobjdump found (set CUOBJDUMP=...)" >&2; exit 2; }
# cuobjdump runs nvdisasm, from PATH: an nvdisasm beside it counts too.
export PATH="$PATH:$(dirname "$cuobjdump")"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
out=${KEEP:-$work/out}
mkdir -p "$out"

# What CMake passes for CUDA sources in a Release build (xla_ext/CMakeLists.txt).
flags=(-O3 -DNDEBUG -std=c++17 -O3 --use_fast_math -lineinfo --expt-relaxed-constexpr
       -Xcompiler=-fPIC)

# A tree's xla_ext/ in a folder: the folder itself, or a git revision exported.
tree_of() {  # name spec -> prints the folder
  local name=$1 spec=$2
  if [ -d "$spec/xla_ext" ]; then
    (cd "$spec" && pwd)
  else
    local dir=$work/$name
    mkdir -p "$dir"
    git -C "$repo" archive "$spec" xla_ext | tar -x -C "$dir"
    echo "$dir"
  fi
}

# All kernels of a tree for one architecture, as lines "kernel<TAB>n<TAB>SASS line", sorted.
# nvcc names an anonymous namespace after a hash of the translation unit and its file name
# (_GLOBAL__N__<hash>_<len>_<file>_<hash>); both are dropped, as they change with any edit.
disassemble() {  # tree arch listing
  local tree=$1 arch=$2 listing=$3 tmp
  tmp=$(mktemp -d -p "$work")
  if ! find "$tree/xla_ext/cuda" -maxdepth 1 -name '*.cu' | sort | xargs -P "$jobs" -I{} sh -c '
    f=$1; shift; tmp=$1; shift; arch=$1; shift; nvcc=$1; shift; xla=$1; shift; tree=$1; shift
    name=$(basename "$f" .cu)
    "$nvcc" "$@" -isystem "$xla" -I"$tree/xla_ext" -cubin \
      -gencode "arch=compute_$arch,code=sm_$arch" -o "$tmp/$name.cubin" "$f" \
      > "$tmp/$name.log" 2>&1 || { cat "$tmp/$name.log" >&2; exit 255; }
  ' _ {} "$tmp" "$arch" "$nvcc" "$XLA_DIR" "$tree" "${flags[@]}"; then
    echo "compiling $tree for sm_$arch failed" >&2
    exit 2
  fi
  # The namespace's mangled length before it and a number nvcc may append after it go too.
  local anon='[0-9]+_GLOBAL__N__[0-9a-f]{8}_[0-9]+_[A-Za-z0-9_]+_[0-9a-f]{8}(_[0-9]+)?'
  for c in "$tmp"/*.cubin; do
    "$cuobjdump" -sass "$c"
  done | sed -E "s/$anon/_GLOBAL__N_/g" |
    awk -v OFS='\t' '
      /^[[:space:]]*Function : / { name = $3; n = 0; next }
      name != "" && /^[[:space:]]*\.section|^[[:space:]]*\.\.\.\.\.\.\.\.\.\./ { name = ""; next }
      name != "" { print name, sprintf("%08d", n++), $0 }' |
    sort -t "$(printf '\t')" -k1,1 -k2,2 > "$listing"
  rm -rf "$tmp"
}

listing_of() {  # name spec arch -> prints the listing file
  local name=$1 spec=$2 arch=$3 key listing
  if [ -n "${SASS_CACHE:-}" ] && [ ! -d "$spec/xla_ext" ] &&
      key=$(git -C "$repo" rev-parse --verify -q "$spec^{commit}"); then
    listing=$SASS_CACHE/$key/sm_$arch.sass
    if [ ! -s "$listing" ]; then
      mkdir -p "$(dirname "$listing")"
      disassemble "$(tree_of "$name" "$spec")" "$arch" "$listing.tmp"
      mv "$listing.tmp" "$listing"
    fi
  else
    listing=$out/$name.sm_$arch.sass
    disassemble "$(tree_of "$name" "$spec")" "$arch" "$listing"
  fi
  echo "$listing"
}

status=0
for arch in $archs; do
  a=$(listing_of old "$old" "$arch")
  b=$(listing_of new "$new" "$arch")
  # Kernels on one side only, then kernels on both whose instructions (encodings included)
  # differ: the names on the lines where the sorted listings differ.
  cut -f1 "$a" | uniq > "$work/names.old"
  cut -f1 "$b" | uniq > "$work/names.new"
  comm -23 "$work/names.old" "$work/names.new" | sed 's/^/  only in OLD: /' > "$work/report"
  comm -13 "$work/names.old" "$work/names.new" | sed 's/^/  only in NEW: /' >> "$work/report"
  comm -12 "$work/names.old" "$work/names.new" > "$work/names.both"
  { diff "$a" "$b" || true; } | sed -n 's/^[<>] //p' | cut -f1 | sort -u |
    comm -12 - "$work/names.both" | sed 's/^/  differs: /' >> "$work/report"
  total=$(sort -u "$work/names.old" "$work/names.new" | wc -l)
  if [ -s "$work/report" ]; then
    echo "sm_$arch: $total kernels, $(wc -l < "$work/report") not identical:"
    cat "$work/report"
    status=1
  else
    echo "sm_$arch: $total kernels, identical"
  fi
done
exit $status
