"""fa3: FA3-style attention forward for Hopper (sm_90a) in the CuTe DSL.

`interface` holds the version contract (docs/versions.md); `kernels` the kernel class
(`decode` the KV-cache decode kernel's),
`configs` the tile table (16-bit and e4m3), `compile` the compile cache (`disk_cache` its
on-disk level). The no-GPU compile probe and the H200 ablation scripts live in the
repository's benchmarks/ folder, outside the installed package. Importing this package imports
nothing heavy: the CuTe DSL is loaded only when a kernel is compiled (a binary loaded from the
disk cache needs TVM-FFI alone).
"""
