#!/usr/bin/env bash
# Run here, where the package registries answer: puts in .device/ (git-ignored) what
# bench/device/run.sh installs on a lent machine that reaches no network: swarm's wheel and
# its locked dependencies for that machine's Python (DEVICE_PYTHON, default 3.12, the lent
# machines' python3), pip's own wheel, and Debian's bubblewrap, slirp4netns and iproute2
# with the libraries they link (for a machine without them). Then, with the device tool:
#   run(command="bash bench/device/run.sh", carry=[".device"], timeout_s=600)
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${DEVICE_PYTHON:-3.12}
out=.device
rm -rf "$out"
mkdir -p "$out/wheels" "$out/debs"
python3 -m pip wheel -q --disable-pip-version-check --no-deps -w "$out/wheels" .
platforms=()
for p in manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_28_x86_64 linux_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --disable-pip-version-check -d "$out/wheels" -c constraints.txt \
  --python-version "$py" --implementation cp --only-binary=:all: "${platforms[@]}" \
  "$(ls "$out"/wheels/swarm_agent-*.whl)" pip 2>"$out/pip.log" \
  || { grep -v "^WARNING: Location" "$out/pip.log"; echo "pip download failed (above)"; exit 1; }
# The packages of the tools, and of every library they link but libc's.
(cd "$out/debs" && apt-get download -q bubblewrap slirp4netns iproute2 libslirp0 libglib2.0-0 \
  libseccomp2 libcap2 libselinux1 libpcre2-8-0 libbpf1 libelf1 libmnl0 libbsd0 libmd0 \
  zlib1g >../apt.log 2>&1) || { cat "$out/apt.log"; echo "apt-get download failed (above)"; exit 1; }
rm -f "$out/pip.log" "$out/apt.log"
echo "$(ls "$out/wheels" | wc -l) wheels, $(ls "$out/debs" | wc -l) Debian packages, $(du -sh "$out" | cut -f1) in $out/"
