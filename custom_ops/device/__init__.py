"""Device helpers no op owns, shared by the kernel families: where kernels run (target.py), fp16 conversions (fp16.py,
half2.py; half_cpu.py for the Numba CPU kernels), loads and stores (memory.py), inline-PTX wrappers (ptx.py), the
tensor-core mma (mma.py), activations (activations.py), scalar arithmetic (arith.py), split-K state (splitk.py),
launching compiled kernels (launch.py) and cuBLAS (cublas.py), the CPU kernels' native entry points (native.py),
and host-side input checks shared by families (inputs.py). Imports only runtime/ and the core, never a family.
Nothing is imported here: numba.cuda is loaded only by the modules that need it."""
