"""C++ CPU kernels, built on first use by torch's extension builder (build.py): the native engine's ragged decode
attention and fused decode ops (rollout/native), and the training pass's fused RMSNorm and SiLU x up (elementwise.py,
used by engine/fused_modules.py). Each computes what the torch ops it replaces compute, bit for bit; where there is
no compiler the callers run those torch ops.

- build.py        the one module of csrc/*.cpp: built once per machine and CPU kind, then loaded
- elementwise.py  RMSNorm and SiLU(gate) * up as autograd functions over csrc/train_elementwise.cpp
"""
