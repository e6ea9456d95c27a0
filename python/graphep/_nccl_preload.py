"""One libnccl per process: PyTorch's, when its wheel ships one.

libgraphep needs libnccl.so.2 and so does PyTorch; the dynamic loader resolves both to whichever
library of that name is loaded first. Loaded first through graphep, the system NCCL would also
serve PyTorch, which may need a newer one. So, where an nvidia-nccl wheel (what PyTorch's CUDA
wheels depend on) is installed, its library is loaded before graphep's extension: found by path,
without importing PyTorch. A communicator PyTorch made can then be adopted too
(Group.adopt_nccl), both sides calling the same NCCL.
"""

import ctypes
import glob
import importlib.util
import os


def preload_wheel_nccl() -> None:
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return
    if spec is None or not spec.submodule_search_locations:
        return
    for root in spec.submodule_search_locations:  # nvidia/nccl/lib (cu12), nvidia/cu13/lib (cu13)
        for lib in sorted(glob.glob(os.path.join(root, "*", "lib", "libnccl.so.2"))):
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
            return
