"""The C++ CPU kernels and their loader (cpu_kernels.py; the CPU's identity: cpu_identity.py): the matmul
(cpu_matmul.cc; quantized weights: cpu_matmul_quant.cc exact, cpu_matmul_int8.cc integer dots, their
formats in formats.py), causal attention (cpu_attention.cc) and the KV caches' copies (cpu_prefix.cc,
called through cpu_copies.py), prebuilt in wheels per instruction set (variants.py) or compiled on first
use (build.py) and called from jitted programs through JAX's FFI; the layout each kernel wants its weights
in is chosen here, every layer's stacked into one array a field (stacking.py). Where they do not apply (no
prebuilt library the CPU runs and no compiler, not x86-64 with AVX2/FMA, JAXSMOL_KERNELS=off, a mesh),
XLA's ops run instead. Imports: jaxsmol.system, jaxsmol.errors."""
