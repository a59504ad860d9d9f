#!/usr/bin/env bash
# make test-arm: the aarch64 path of the kernels (NEON + dotprod, what every RK3588 board runs),
# built and tested on an x86_64 machine under user-mode emulation of a Cortex-A76.
#
#   1. host packages (Debian): aarch64 cross gcc, qemu-user-static, debootstrap
#   2. an arm64 Debian root: debootstrap --foreign (first stage only) + plain extraction of the
#      downloaded .debs; no emulated second stage, no chroot, no binfmt_misc, no mount
#   3. arm64 wheels from PyPI (numpy, tokenizers, jinja2, pytest, hypothesis, ...) at the versions
#      the host's Python has, installed into the root's /opt/pydeps
#   4. the host computes the tiny-model reference (transformers, numpy twin of the kernels)
#   5. cross build_ext of appliance.kernels._kernels with the host Python's Cython and
#      aarch64-linux-gnu-gcc; objdump counts the sdot instructions and says where they are
#   6. under qemu-aarch64-static -cpu cortex-a76: kernel tests + tests/arm (path, bit-exact integer
#      parts, tiny-model forward) and `appliance selftest`
#   7. negative control under -cpu cortex-a72 (no dotprod): the runtime feature check refuses the
#      build with a clear message; a raw kernel call that bypasses the check dies with SIGILL
#   8. a build for a CPU without dotprod (-march=armv8-a) falls back to plain NEON or portable, and
#      passes `appliance selftest` and tests/arm on the cortex-a72
#
# Everything downloaded or built is cached under $APPLIANCE_ARM_WORK (default /var/cache/appliance-arm),
# outside the repository. Needs root (apt, debootstrap).
#
# Environment:
#   APPLIANCE_ARM_WORK   cache and build directory (default /var/cache/appliance-arm)
#   HOST_PY              host Python with Cython + setuptools (and torch/transformers for the
#                        reference); default: the repo's .venv/bin/python
#   ARM_EXPECT_PATH      kernel path the default build must report (default neon-dotprod; "any" = no check)
#   ARM_MARCH            flags of the main build (default: setup.py's, -march=armv8.2-a+dotprod+fp16)
#   ARM_TESTS            pytest arguments for the emulated run (default: tests/kernels tests/arm)
#   ARM_FALLBACK=0       skip step 8
#   ARM_SRC              source tree to build and test (default: this repository's work tree)
#   MIRROR, SUITE        Debian mirror and suite of the arm64 root (default deb.debian.org, bookworm)
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "${ARM_SRC:-$HERE/../..}" && pwd)
WORK=${APPLIANCE_ARM_WORK:-/var/cache/appliance-arm}
HOST_PY=${HOST_PY:-$HERE/../../.venv/bin/python}
# absolute (the builds run elsewhere), without resolving the venv's symlink
HOST_PY=$(cd "$(dirname "$HOST_PY")" 2>/dev/null && pwd)/$(basename "$HOST_PY")
EXPECT=${ARM_EXPECT_PATH:-neon-dotprod}
ARM_TESTS=${ARM_TESTS:-tests/kernels tests/arm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SUITE=${SUITE:-bookworm}
ROOT=$WORK/root-$SUITE
T0=$(date +%s)
STEP=start
step() { STEP=$1; echo; echo "=== test-arm [$(( $(date +%s) - T0 ))s] $*"; }
die() { echo "test-arm: FAIL: $*" >&2; exit 1; }
trap 'rc=$?; [ $rc -eq 0 ] || echo "test-arm: FAIL at step $STEP (rc=$rc, after $(( $(date +%s) - T0 ))s)" >&2' EXIT

mkdir -p "$WORK"
# One run at a time per cache (the machines are shared; two runs would fight over the root).
exec 9>"$WORK/.lock"
flock 9

step "1. host packages"
HOST_PKGS="gcc-aarch64-linux-gnu libc6-dev-arm64-cross binutils-aarch64-linux-gnu qemu-user-static debootstrap"
if ! dpkg-query -W -f='${Status}\n' $HOST_PKGS 2>/dev/null | grep -qv "install ok installed" \
   && [ "$(dpkg-query -W -f='${Status}\n' $HOST_PKGS 2>/dev/null | wc -l)" -eq 5 ]; then
  echo "already installed: $HOST_PKGS"
else
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=600 update -qq
  # libc6-dev-arm64-cross is only a Recommends of gcc-aarch64-linux-gnu: named explicitly.
  apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends $HOST_PKGS >/dev/null
fi
qemu-aarch64-static --version | head -1
aarch64-linux-gnu-gcc --version | head -1

step "2. arm64 Debian root ($ROOT)"
# python3-dev: headers + the arm64 _sysconfigdata; libgomp1: the OpenMP runtime the kernels link.
INCLUDE=python3,python3-dev,libgomp1
if [ "$(cat "$ROOT/.appliance-stamp" 2>/dev/null)" != "$SUITE $INCLUDE" ]; then
  rm -rf "$ROOT" "$ROOT.tmp"
  debootstrap --arch=arm64 --variant=minbase --foreign --include=$INCLUDE \
    "$SUITE" "$ROOT.tmp" "$MIRROR" > "$WORK/debootstrap.log" 2>&1 \
    || { tail -30 "$WORK/debootstrap.log"; die "debootstrap failed (log: $WORK/debootstrap.log)"; }
  for deb in "$ROOT.tmp"/var/cache/apt/archives/*.deb; do
    # --keep-directory-symlink keeps merged /usr (/bin, /lib -> usr/...) intact
    dpkg-deb --fsys-tarfile "$deb" | tar -x --keep-directory-symlink -C "$ROOT.tmp"
  done
  rm -f "$ROOT.tmp"/var/cache/apt/archives/*.deb
  # The first stage leaves proc -> /proc (the host's): make it a plain directory.
  if [ -L "$ROOT.tmp/proc" ]; then rm -f "$ROOT.tmp/proc"; mkdir -m 555 "$ROOT.tmp/proc"; fi
  echo "$SUITE $INCLUDE" > "$ROOT.tmp/.appliance-stamp"
  mv "$ROOT.tmp" "$ROOT"
fi
[ -x "$ROOT/usr/bin/python3.11" ] || die "no python3.11 in the arm64 root"
echo "root: $(du -sh "$ROOT" | cut -f1), $("$ROOT/usr/bin/python3.11" --version 2>/dev/null || echo 'arm64 python3.11')"

step "3. host Python and arm64 wheels"
[ -x "$HOST_PY" ] || die "HOST_PY=$HOST_PY is not an executable (run \`make setup\` first)"
"$HOST_PY" -c 'import Cython, setuptools' 2>/dev/null || die "$HOST_PY has no Cython/setuptools"
echo "host: $("$HOST_PY" -c 'import sys, Cython; print(sys.version.split()[0], "Cython", Cython.__version__)')"
# The guest gets the same versions as the host (so numpy behaves the same on both sides).
SPECS=$("$HOST_PY" "$HERE/wheel_specs.py")
PYDEPS=$ROOT/opt/pydeps
if [ "$(cat "$PYDEPS/.appliance-stamp" 2>/dev/null)" != "$SPECS" ]; then
  rm -rf "$PYDEPS"
  mkdir -p "$WORK/wheels"
  PLAT="--platform manylinux2014_aarch64 --platform manylinux_2_28_aarch64 --python-version 3.11 --implementation cp"
  # shellcheck disable=SC2086
  "$HOST_PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: $PLAT \
    -d "$WORK/wheels" $SPECS 2> >(grep -v "is ignored: it is neither" >&2)
  # shellcheck disable=SC2086
  "$HOST_PY" -m pip install -q --disable-pip-version-check --no-deps --no-index --find-links "$WORK/wheels" \
    --only-binary=:all: $PLAT --target "$PYDEPS" $SPECS 2> >(grep -v "is ignored: it is neither" >&2)
  echo "$SPECS" > "$PYDEPS/.appliance-stamp"
fi
echo "arm64 wheels: $(echo $SPECS)"
NPINC=$PYDEPS/numpy/_core/include
[ -d "$NPINC" ] || NPINC=$PYDEPS/numpy/core/include

step "4. tiny-model reference on the host (transformers + the kernels' numpy twin)"
REF_DIR=$WORK/reference
"$HOST_PY" "$HERE/make_reference.py" --repo "$REPO" --out "$REF_DIR"
REF_NPZ=$REF_DIR/reference.npz

# cross_build DIR FLAGS: copy the tree to DIR and build the extension for aarch64 there.
SCD=$WORK/sysconfig
mkdir -p "$SCD"
cp "$ROOT"/usr/lib/python3.11/_sysconfigdata__linux_aarch64-linux-gnu.py "$SCD/"
cross_build() {
  local dir=$1 march=$2 cython_from=${3:-}
  rm -rf "$dir"; mkdir -p "$dir"
  if git -C "$REPO" rev-parse --git-dir >/dev/null 2>&1; then
    # tracked + untracked-not-ignored files: what a commit of this tree would hold
    (cd "$REPO" && git ls-files -z -co --exclude-standard | tar --null -T - --ignore-failed-read -cf - 2>/dev/null) \
      | tar -xf - -C "$dir"
  else
    (cd "$REPO" && tar --exclude=./.git --exclude=./.venv --exclude=./build --exclude='*.so' -cf - .) | tar -xf - -C "$dir"
  fi
  rm -f "$dir"/appliance/kernels/*.so "$dir"/appliance/*.so "$dir"/kernels/kernels.c
  # The Cython output does not depend on the target flags: reuse it (newer than the .pyx, so
  # cythonize skips it) rather than generate it again.
  if [ -n "$cython_from" ]; then cp -p "$cython_from"/kernels/kernels.c "$dir"/kernels/; fi
  # APPLIANCE_MARCH / APPLIANCE_PORTABLE of the caller's environment do not leak into the builds.
  (cd "$dir" && env -u APPLIANCE_MARCH -u APPLIANCE_PORTABLE \
    _PYTHON_HOST_PLATFORM=linux-aarch64 \
    _PYTHON_SYSCONFIGDATA_NAME=_sysconfigdata__linux_aarch64-linux-gnu PYTHONPATH="$SCD" \
    CC="aarch64-linux-gnu-gcc --sysroot=$ROOT" \
    LDSHARED="aarch64-linux-gnu-gcc --sysroot=$ROOT -shared" \
    CFLAGS="-I$NPINC -I$ROOT/usr/include/python3.11 -Werror=implicit-function-declaration" \
    LDFLAGS="" \
    NUMPY_INCLUDE="$NPINC" CYTHON_INCLUDE_PATH="$PYDEPS" \
    ${march:+APPLIANCE_MARCH="$march"} \
    "$HOST_PY" setup.py build_ext --inplace --parallel 2 > "$dir.build.log" 2>&1) \
    || { tail -40 "$dir.build.log"; die "cross build failed (log: $dir.build.log)"; }
  ls "$dir"/appliance/kernels/_kernels.cpython-311-aarch64-linux-gnu.so \
    >/dev/null || die "the cross build made no aarch64 extension"
}

# qpy CPU [ENV=VAL ...] -- ARGS: the arm64 python under qemu-user, from build dir $BUILD.
qpy() {
  local cpu=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  (cd "$BUILD" && env -i PATH=/usr/bin:/bin HOME=/tmp LANG=C.UTF-8 PYTHONPATH=/opt/pydeps:"$BUILD":"$BUILD/tests/arm" \
    PYTHONDONTWRITEBYTECODE=1 OMP_NUM_THREADS=2 QEMU_LD_PREFIX="$ROOT" QEMU_CPU="$cpu" "${envs[@]}" \
    qemu-aarch64-static "$ROOT/usr/bin/python3.11" "$@")
}

step "5. cross build for aarch64 (${ARM_MARCH:-setup.py default flags})"
BUILD=$WORK/build-main
cross_build "$BUILD" "${ARM_MARCH:-}"
show_flags() {   # the target flags setup.py gave the compiler, from the build log
  echo "target flags: $(grep -h "arm/neon\.c" "$1.build.log" | head -1 | grep -o -- "-m\(arch\|cpu\)=[^ ]*" | sort -u | tr '\n' ' ')"
}
show_flags "$BUILD"
"$HOST_PY" "$HERE/sdot_report.py" "$BUILD" --expect-path "$EXPECT" | tee "$WORK/sdot-report.txt"

step "6. tests under qemu-aarch64 -cpu cortex-a76 (RK3588 big core: asimd, dotprod, fp16)"
PATH_A76=$(qpy cortex-a76 -- -c 'from appliance.kernels import _kernels as k; print(k.kernel_path())')
echo "kernel_path() on cortex-a76: $PATH_A76"
if [ "$EXPECT" != any ] && [ "$PATH_A76" != "$EXPECT" ]; then
  die "the aarch64 build runs the '$PATH_A76' path, expected '$EXPECT'"
fi
EXPECT_ENV=APPLIANCE_EXPECT_PATH=$PATH_A76
[ "$EXPECT" = any ] || EXPECT_ENV=APPLIANCE_EXPECT_PATH=$EXPECT
# shellcheck disable=SC2086
qpy cortex-a76 "$EXPECT_ENV" APPLIANCE_ARM_REFERENCE="$REF_NPZ" APPLIANCE_ARM_EMULATED=1 -- \
  -m pytest -q -p no:cacheprovider -p emulation $ARM_TESTS
echo "--- appliance selftest (cortex-a76)"
qpy cortex-a76 -- -m appliance selftest || die "appliance selftest failed on cortex-a76"

if [ "$PATH_A76" = neon-dotprod ]; then
  step "7. negative control: the same build under qemu -cpu cortex-a72 (ARMv8.0: no dotprod)"
  set +e
  out=$(qpy cortex-a72 -- -c 'from appliance.kernels import dispatch' 2>&1); rc=$?
  set -e
  echo "$out" | tail -1
  [ $rc -eq 1 ] && echo "$out" | grep -q "ApplianceError: this CPU lacks" \
    || die "importing appliance.kernels.dispatch on cortex-a72: rc=$rc, expected a clear ApplianceError (rc 1)"
  echo "OK: appliance.kernels.dispatch refuses the build with an ApplianceError (rc=$rc), no SIGILL"
  set +e
  out=$(qpy cortex-a72 -- -m appliance selftest 2>&1); rc=$?
  set -e
  echo "$out"
  [ $rc -eq 1 ] && echo "$out" | grep -q "^selftest: FAIL: this CPU cannot run the neon-dotprod path" \
    || die "appliance selftest on cortex-a72: rc=$rc, expected a FAIL line and exit 1"
  echo "OK: appliance selftest says FAIL and exits 1 (rc=$rc), no SIGILL"
  # Proof that the checked path is the sdot one: bypassing the check, the kernel itself traps.
  set +e
  qpy cortex-a72 -- -c '
import numpy as np
from appliance.kernels import _kernels as k
w = np.ones((8, 64), np.int8); d = np.ones((8, 2), np.float16)
x = np.ones((1, 64), np.int8); xd = np.ones((1, 2), np.float32)
print(k.gemm_q8(w, d, x, xd, path="simd"))' >/dev/null 2>&1; rc=$?
  set -e
  [ $rc -eq 132 ] || die "a raw gemm_q8(path='simd') on cortex-a72 exited rc=$rc, expected SIGILL (132)"
  echo "OK: bypassing the check, gemm_q8(path='simd') dies with SIGILL (rc=$rc): the sdot code is what runs"
  # Information only: the portable C of a +dotprod build may hold auto-vectorised sdot (see step 5).
  set +e
  qpy cortex-a72 -- -c '
import numpy as np
from appliance.kernels import _kernels as k
w = np.ones((64, 1024), np.int8); d = np.ones((64, 32), np.float16)
x = np.ones((4, 1024), np.int8); xd = np.ones((4, 32), np.float32)
k.gemm_q8(w, d, x, xd, path="portable")' >/dev/null 2>&1; rc=$?
  set -e
  if [ $rc -eq 0 ]; then echo "info: gemm_q8(path='portable') of this build runs on cortex-a72"
  else echo "info: gemm_q8(path='portable') of this build dies on cortex-a72 (rc=$rc): auto-vectorised sdot in portable C"; fi
else
  step "7. negative control skipped: the build's path is '$PATH_A76', not neon-dotprod"
fi

if [ "${ARM_FALLBACK:-1}" = 1 ]; then
  step "8. a build for a CPU without dotprod (APPLIANCE_MARCH=-march=armv8-a) on -cpu cortex-a72"
  BUILD=$WORK/build-armv8
  cross_build "$BUILD" "-march=armv8-a" "$WORK/build-main"
  show_flags "$BUILD"
  "$HOST_PY" "$HERE/sdot_report.py" "$BUILD" --expect-path none
  PATH_A72=$(qpy cortex-a72 -- -c 'from appliance.kernels import _kernels as k; print(k.kernel_path())')
  echo "kernel_path() of the armv8-a build on cortex-a72: $PATH_A72"
  case $PATH_A72 in neon|portable) ;; *) die "an armv8-a build reports '$PATH_A72', expected neon or portable";; esac
  qpy cortex-a72 APPLIANCE_EXPECT_PATH="$PATH_A72" APPLIANCE_ARM_EMULATED=1 -- \
    -m pytest -q -p no:cacheprovider -p emulation tests/arm/test_arm_path.py
  qpy cortex-a72 -- -m appliance selftest || die "appliance selftest of the armv8-a build failed on cortex-a72"
fi

step "done: make test-arm passed"
