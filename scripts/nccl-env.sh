# Source this (`. scripts/nccl-env.sh`) before running flashsample's tensor-parallel code
# (tests/tests/tp.rs, tp_bench) on a machine whose NCCL comes from PyTorch's pip wheel.
#
# Why: cudarc dlopens NCCL under the names cudarc::get_lib_name_candidates("nccl") lists
# (libnccl.so, libnccl.so.12, libnccl.so.11, ..., libnccl.so.1) but not libnccl.so.2, the only
# name the wheel (site-packages/nvidia/nccl/lib/libnccl.so.2) and NVIDIA's packages ship. The
# dynamic loader reads LD_LIBRARY_PATH at process start, so the link must exist before then:
# this makes $FLASHSAMPLE_NCCL_DIR (default /tmp/flashsample-nccl) hold libnccl.so -> that file
# and prepends it to LD_LIBRARY_PATH. Set FLASHSAMPLE_NCCL_LIB to use another libnccl.so.2.
_fs_nccl_lib=${FLASHSAMPLE_NCCL_LIB:-}
if [ -z "$_fs_nccl_lib" ]; then
  _fs_nccl_lib=$(python3 - <<'PY' 2>/dev/null
import glob, os
try:
    import nvidia.nccl
    roots = list(nvidia.nccl.__path__)
except Exception:
    roots = []
try:
    import torch
    roots.append(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "nccl"))
    roots.append(os.path.join(os.path.dirname(torch.__file__), "lib"))
except Exception:
    pass
for r in roots:
    hits = sorted(glob.glob(os.path.join(r, "**", "libnccl.so*"), recursive=True))
    if hits:
        print(os.path.realpath(hits[0]))
        break
PY
)
fi
if [ -z "$_fs_nccl_lib" ]; then
  _fs_nccl_lib=$(ldconfig -p 2>/dev/null | awk '/libnccl\.so/ {print $NF; exit}')
fi
if [ -n "$_fs_nccl_lib" ] && [ -e "$_fs_nccl_lib" ]; then
  _fs_nccl_dir=${FLASHSAMPLE_NCCL_DIR:-/tmp/flashsample-nccl}
  mkdir -p "$_fs_nccl_dir"
  ln -sf "$_fs_nccl_lib" "$_fs_nccl_dir/libnccl.so"
  export LD_LIBRARY_PATH="$_fs_nccl_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "nccl-env: libnccl.so -> $_fs_nccl_lib (in $_fs_nccl_dir, on LD_LIBRARY_PATH)" >&2
else
  echo "nccl-env: no libnccl.so.2 found (pip install nvidia-nccl-cu12, or set FLASHSAMPLE_NCCL_LIB)" >&2
fi
unset _fs_nccl_lib _fs_nccl_dir
