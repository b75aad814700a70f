"""Decoding strategies as functions: greedy, EAGLE-2 speculative decoding, and the speculation
cost model that chooses between them."""
