#!/usr/bin/env bash
# Headless Chromium and its driver for the review pages' browser tests (tests/browser.py), from
# Debian: `chromium` and `chromium-driver` are one version, so the driver always fits the browser.
# Installed with apt-get when missing (as root, or through passwordless sudo). Under CI=true a
# browser that cannot be installed fails the build (the browser tests must run there); elsewhere
# it is a note, and those tests skip saying why.
set -u
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    exit 0
fi
packages=(chromium chromium-driver)
if [ "$(id -u)" -eq 0 ]; then
    as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
else
    as_root=(none)
fi
if [ "${as_root[0]:-}" != none ] && command -v apt-get >/dev/null 2>&1; then
    echo "test: installing ${packages[*]} (browser tests)"
    if "${as_root[@]}" apt-get update -qq \
        && DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq "${packages[@]}" >/dev/null; then
        exit 0
    fi
fi
echo "test: could not install ${packages[*]} (needs apt-get as root)" >&2
if [ "${CI:-}" = "true" ]; then
    exit 1
fi
echo "test: the browser tests will be skipped" >&2
exit 0
