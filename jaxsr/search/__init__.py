"""Searches over a decoder: Best-of-N, Speculative Rejection, TreeBoN, and the scheduler they share."""
