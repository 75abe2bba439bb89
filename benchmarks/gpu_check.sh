#!/bin/sh
# The GPU check on a bare GPU machine (no registry): installs the wheels carried in .whl
# (`make gpu-wheels` fetches them on a machine with one) into a private folder, then runs
# benchmarks/gpu_check.py. Usage: sh benchmarks/gpu_check.sh OUT_DIR [gpu_check.py flags]
set -eu
OUT=${1:?usage: sh benchmarks/gpu_check.sh OUT_DIR [gpu_check.py flags]}
shift
PYTHON=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/hybridserve-gpu-site}
WHEELS=${GPU_CHECK_WHEELS:-.whl}
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
	"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
		--target "$SITE" "$WHEELS"/*.whl
	PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
	export PYTHONPATH
fi
export PYTHONUNBUFFERED=1
exec "$PYTHON" benchmarks/gpu_check.py --out "$OUT" "$@"
