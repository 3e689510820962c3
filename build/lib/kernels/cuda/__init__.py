"""CUDA C++ kernels (sm_90a), compiled on first use: see kernels/cuda/NOTES.md."""
