"""fa2: FlashAttention-2 in Triton (forward + recompute backward); see interface.py."""
