# make test-arm: the aarch64 kernels (NEON + dotprod, what every RK3588 board runs) cross-built and
# tested under qemu-aarch64-static -cpu cortex-a76, with the negative control on cortex-a72 and a
# dotprod-less (-march=armv8-a) build. See scripts/arm/test_arm.sh.
#
# Included from the Makefile after PY and STAMP are defined:   include mk/arm.mk
# Needs root (apt-get, debootstrap). The arm64 root, wheels and builds are cached in ARM_WORK,
# outside the repository: about 1 minute more on a machine that has none of it.
ARM_WORK ?= /var/cache/appliance-arm

.PHONY: test-arm
test-arm: $(STAMP)
	APPLIANCE_ARM_WORK="$(ARM_WORK)" HOST_PY="$(abspath $(PY))" bash scripts/arm/test_arm.sh
