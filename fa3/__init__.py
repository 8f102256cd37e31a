"""fa3: FA3-style attention forward for Hopper (sm_90a) in the CuTe DSL.

`interface` holds the version contract (docs/versions.md); `kernels` the kernel class,
`configs` the tile table, `compile` the compile cache, `probe` the no-GPU compile checks and
`ablate` the H200 correctness/benchmark/ablation script. Importing this package imports nothing
heavy: the CuTe DSL is loaded only when a kernel is compiled.
"""
