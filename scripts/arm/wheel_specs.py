"""Print the arm64 wheels the emulated test run needs, pinned to the versions this (host) Python has.

Same versions on both sides: numpy rounds, prints and seeds alike, and a wheel the host does not
have is taken at its newest. Used by scripts/arm/test_arm.sh (`pip download --platform ...`).
"""
from importlib import metadata

# numpy + what `appliance` imports on the engine path; pytest and hypothesis with their dependencies.
PACKAGES = ["numpy", "tokenizers", "jinja2", "markupsafe",
            "pytest", "pluggy", "iniconfig", "packaging", "pygments",
            "hypothesis", "sortedcontainers"]


def main() -> None:
    specs = []
    for name in PACKAGES:
        try:
            specs.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            specs.append(name)
    print(" ".join(specs))


if __name__ == "__main__":
    main()
