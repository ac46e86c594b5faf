# Source this on the H200 device machine (no registry there): installs the server's wheels and libopus that the
# call carried, so `python3 -m server serve` and bench/run_h200.sh run on the image's torch and triton.
# Made here, once per checkout (both folders are git-ignored; name them in the call's carry list):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 \
#       --platform any -d .whl starlette uvicorn httptools uvloop websockets lameenc prometheus_client \
#       dashscope==2.0.2 sniffio anyio h11
#   pip wheel --no-deps -w .whl opuslib==3.0.1        # an sdist only: pure Python, so the wheel is portable
#   (mkdir -p .deb && cd .deb && apt-get download libopus0)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || return 1
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
# libopus into a folder of its own (not /), registered with the loader's cache: opuslib finds it with
# ctypes.util.find_library, which reads `ldconfig -p`.
mkdir -p /tmp/deb && for f in .deb/*.deb; do dpkg -x "$f" /tmp/deb; done
echo /tmp/deb/usr/lib/x86_64-linux-gnu >/etc/ld.so.conf.d/voicelane-opus.conf && ldconfig
# The device tool's copy of the tree may carry stale git metadata (2026-12-06: it said 594d537 for 63792e7's tree):
# name the commit in the call (VOICELANE_COMMIT=$(git rev-parse --short HEAD) run here, pasted into the command).
if [ -z "${VOICELANE_COMMIT:-}" ]; then
  VOICELANE_COMMIT=$(git rev-parse --short HEAD 2>/dev/null)
  echo "h200_env: VOICELANE_COMMIT=$VOICELANE_COMMIT from this copy's git metadata, which may be stale; set it" >&2
fi
export VOICELANE_COMMIT
export PYTHONUNBUFFERED=1
