#!/usr/bin/env bash
# Run on a lent machine (16 cores, no network), from the repository's root, with .device/
# carried (bench/device/prepare.sh made it): installs swarm from .device/ and takes the width
# figures of `python -m bench --only scaling`, without the sandbox and with it, into $OUT
# (the device tool brings back what is under it): run.log, scaling-<sandbox>.txt and
# <sandbox>/scaling.json.
# Knobs: DEVICE_SIZES (500,2000), DEVICE_WARM (2000), DEVICE_WORKERS (8),
# DEVICE_CONCURRENCY (256), DEVICE_SANDBOX ("none auto").
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/swarm-device}
mkdir -p "$out"
exec > >(tee "$out/run.log") 2>&1
[ -d .device/wheels ] || { echo "no .device/ here: run bench/device/prepare.sh and carry .device"; exit 2; }
echo "== the machine: $(nproc) cores, $(free -g | awk '/^Mem/ {print $2}') GiB, kernel $(uname -r), $(python3 -V 2>&1), $(. /etc/os-release 2>/dev/null; echo "${PRETTY_NAME:-?}")"
# Carried tools only where the machine lacks them, each run through the dynamic loader with
# the carried libraries (for that process only: nothing it starts inherits them).
debs=/opt/swarm-debs
wrappers=/opt/swarm-debs-bin
mkdir -p "$debs" "$wrappers"
for deb in .device/debs/*.deb; do dpkg-deb -x "$deb" "$debs" 2>/dev/null || dpkg -x "$deb" "$debs"; done
libs="$debs/usr/lib/x86_64-linux-gnu:$debs/lib/x86_64-linux-gnu"
loader=$(ls /lib64/ld-linux-x86-64.so.2 2>/dev/null || ls /lib/x86_64-linux-gnu/ld-linux-x86-64.so.2)
have() { local p; p=$(command -v "$1") && [ -f "$p" ] && [ -x "$p" ]; }
for tool in bwrap slirp4netns ip; do
  if have "$tool"; then echo "$tool: the machine's, $(command -v "$tool")"; continue; fi
  real=
  for dir in usr/bin usr/sbin bin sbin; do
    [ -x "$debs/$dir/$tool" ] && { real=$debs/$dir/$tool; break; }
  done
  [ -n "$real" ] || { echo "$tool: missing, and not in .device/debs"; continue; }
  printf '#!/bin/sh\nexec %s --library-path %s %s "$@"\n' "$loader" "$libs" "$real" \
    > "$wrappers/$tool"
  chmod +x "$wrappers/$tool"
  echo "$tool: carried, $({ "$wrappers/$tool" --version || "$wrappers/$tool" -V; } 2>&1 | grep -vi option | head -1)"
done
export PATH="$PATH:$wrappers"
for v in $(compgen -e | grep '^PIP_'); do unset "$v"; done  # no pip settings of the machine's
for tool in nsenter setpriv unshare python3; do echo "$tool: $(command -v "$tool" || echo MISSING)"; done
# A virtual environment of its own; where python3 cannot make one with pip, pip from its wheel.
venv=/tmp/swarm-venv
rm -rf "$venv"
if python3 -m venv "$venv" 2>/dev/null; then pip=("$venv/bin/python" -m pip)
else
  python3 -m venv --without-pip "$venv" || exit 1
  pip=("$venv/bin/python" "$(ls .device/wheels/pip-*.whl)/pip")
fi
PIP_CONFIG_FILE=/dev/null "${pip[@]}" install -q --disable-pip-version-check --no-index \
  --find-links .device/wheels swarm-agent || exit 1
. "$venv/bin/activate"
python -c "import swarm, celery, redis; print('the bench runs this tree\'s swarm,', swarm.__file__, '(the environment holds its dependencies)')"
trial=$(python -c "from swarm.agent import sandbox; p = sandbox.probe(); print('works' if p.ok else 'fails: ' + p.reason)")
echo "the sandbox's trial: $trial"
for sandbox in ${DEVICE_SANDBOX:-none auto}; do
  if [ "$sandbox" != none ] && [ "$trial" != works ]; then echo "== --sandbox $sandbox skipped"; continue; fi
  echo "== python -m bench --only scaling, --sandbox $sandbox ($(date +%T))"
  python -m bench --only scaling --sizes "${DEVICE_SIZES:-500,2000}" \
    --warm-up "${DEVICE_WARM:-2000}" --workers "${DEVICE_WORKERS:-8}" \
    --concurrency "${DEVICE_CONCURRENCY:-256}" --sandbox "$sandbox" --no-seed --no-plot \
    --results "$out/$sandbox" > "$out/scaling-$sandbox.txt" 2>&1
  echo "exit $?"
  grep -E "wall|least wall|CPU ms a child|sandbox" "$out/scaling-$sandbox.txt" | head -20
done
echo "== done ($(date +%T))"
