#!/usr/bin/env bash
# The benchmarks' baselines: pdftoppm (poppler-utils) and ffmpeg. Installed with apt-get when
# missing and running as root; otherwise a note, and the benchmarks skip those arms (they say so
# in their results). Never fails the build.
missing=()
command -v pdftoppm >/dev/null 2>&1 || missing+=(poppler-utils)
command -v ffmpeg >/dev/null 2>&1 || missing+=(ffmpeg)
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "bench: installing ${missing[*]} (baselines)"
    if apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; then
        exit 0
    fi
fi
echo "bench: could not install ${missing[*]}: the pdftoppm/ffmpeg baselines will be skipped" >&2
exit 0
