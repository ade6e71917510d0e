"""C++ CPU kernels, built on first use by torch's extension builder (build.py): the native engine's ragged decode
attention and fused decode ops (rollout/native), and the training pass's fused RMSNorm, SiLU x up, attention softmax
and the packed attention's moves into rows and back (elementwise.py, packed_rows.py; used by engine/fused_modules.py
and engine/packing.py). Each computes what the torch ops it replaces compute, bit for bit; where there is no compiler
the callers run those torch ops.

- build.py        the one module of csrc/*.cpp: built once per machine and CPU kind, then loaded
- elementwise.py  RMSNorm, SiLU(gate) * up and the causal softmax as autograd functions over csrc/train_*.cpp
- packed_rows.py  q, k, v from the packed tokens into the attention's rows, and its output back (csrc/packed_rows.cpp)
"""
