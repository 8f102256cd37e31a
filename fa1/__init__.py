"""fa1: the FlashAttention-1 loop order (outer K/V, inner Q, O/m/l in HBM) in Triton."""
