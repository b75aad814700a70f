"""The project's native CPU kernels and the CPU facts they are chosen by: low-bit GEMMs and the
bfloat16 attention (`lowbit_kernels.cpp`), the decoder layer's small operators (`layer_ops.cpp`), built
on first use by `lowbit_kernels.py`, and
/proc/cpuinfo (`cpuinfo.py`). Below `models` and `weights`, which both call them: the model code's
attention, norms, RoPE and SwiGLU, and the weight forms' GEMMs."""
