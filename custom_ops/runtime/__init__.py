"""The onnxruntime bridge: the C shim (ortshim.c, built by build.py, its ABI mirrored in abi.py), the Python half that
declares the ops and serves the shim's callbacks (bridge.py), the Kernel base class and the op -> family module table
(kernels.py), native replay plans of CUDA launches and CPU entry points (plans.py), the CUDA driver through ctypes
(driver.py) and calling a kernel object on the caller's device arrays (direct.py). Imports no family: kernels are
found through kernels.FAMILIES (importlib)."""
