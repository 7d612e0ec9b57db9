"""Attention fusions into GroupQueryAttention, their proofs and the symbolic evaluator behind them."""
